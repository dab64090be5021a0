"""The official `openai` client against a live server on the embedded SmolLM2-135M-Instruct: the
session's shared float32 server (shared_servers.SMOLLM2_TOOLS_ARGS). Its tool and reasoning
parsers act only on requests with tools, and on replies that open with `<think>`: none here."""

from __future__ import annotations

import pytest

import httpx

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

# float32: these tests compare greedy texts across requests batched differently, which bf16 (the
# CPU default where it is native) does not keep bit-identical; the default dtype is covered by
# tests/models/test_smollm2.py::test_default_dtype_says_paris. The offline Engine runs as the
# server's scheduler does (float32, one forward thread).
ENGINE_ARGS = ["model.dtype=float32", "scheduler.cpu_threads=1"]
MODEL = "smollm2-135m-instruct"
PARIS = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def server(smollm2_tools_server):
    return smollm2_tools_server


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(api_key="unused", base_url=server.url + "/v1", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from moeserve.models.embedded import embedded_model_path

    return AutoTokenizer.from_pretrained(embedded_model_path())


def chat_ids(tokenizer, messages) -> list[int]:
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def chat(client, **kw):
    return client.chat.completions.create(model=MODEL, messages=kw.pop("messages", PARIS), **kw)


def test_models_list(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_chat_paris_usage_and_offline_engine_parity(client, server, tokenizer):
    from moeserve import Engine

    out = chat(client, max_tokens=24, **GREEDY)
    text = out.choices[0].message.content
    assert "Paris" in text
    ids = chat_ids(tokenizer, PARIS)
    assert out.usage.prompt_tokens == len(ids)
    assert out.usage.total_tokens == len(ids) + out.usage.completion_tokens
    native = httpx.post(server.url + "/generate", timeout=120, json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": 24, "temperature": 0.0}}).json()
    with Engine(overrides=ENGINE_ARGS) as engine:
        offline = engine.generate(input_ids=[ids], sampling_params={"max_new_tokens": 24,
                                                                     "temperature": 0.0})[0]
    assert native["output_ids"] == offline["output_ids"]  # token-identical
    assert text == native["text"] == offline["text"]


def test_max_tokens_gives_length(client, tokenizer):
    prompt = "The history of the Roman Empire"
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=7, extra_body={
        "ignore_eos": True}, **GREEDY)
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 7
    assert out.usage.prompt_tokens == len(tokenizer(prompt)["input_ids"])
    assert out.usage.prompt_tokens_details.cached_tokens >= 0


@pytest.mark.parametrize("kind", ["chat", "completions"])
def test_stream_equals_non_stream_with_usage(client, kind):
    kw = dict(max_tokens=16, stream_options={"include_usage": True}, **GREEDY)
    if kind == "chat":
        full = chat(client, max_tokens=16, **GREEDY)
        chunks = list(chat(client, stream=True, **kw))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        expected = full.choices[0].message.content
    else:
        full = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=16,
                                         **GREEDY)
        chunks = list(client.completions.create(model=MODEL, prompt="Once upon a time",
                                                stream=True, **kw))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        expected = full.choices[0].text
    assert text == expected
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == full.choices[0].finish_reason and not any(finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None  # the include_usage chunk
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def _stop_word(text: str) -> str:
    """A word from the middle of `text` (so the cut is neither empty nor the whole text)."""
    words = [w for w in text.split() if w.isalpha() and len(w) > 2]
    return words[len(words) // 2]


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_excluded(client, stream):
    prompt = [{"role": "user", "content": "Write three sentences about the sea."}]
    full = chat(client, messages=prompt, max_tokens=40, **GREEDY).choices[0].message.content
    stop = _stop_word(full)
    if stream:
        chunks = list(chat(client, messages=prompt, max_tokens=40, stop=[stop], stream=True,
                           **GREEDY))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        reason = chunks[-1].choices[0].finish_reason
    else:
        out = chat(client, messages=prompt, max_tokens=40, stop=[stop, "unlikely-zzz"], **GREEDY)
        text, reason = out.choices[0].message.content, out.choices[0].finish_reason
    assert text == full[: full.index(stop)] and stop not in text
    assert reason == "stop"


def test_n_choices(client):
    out = chat(client, n=3, max_tokens=8, temperature=1.0, seed=7)
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert 3 <= out.usage.completion_tokens <= 3 * 8  # summed over the choices
    assert out.usage.prompt_tokens == chat(client, max_tokens=1).usage.prompt_tokens  # counted once
    chunks = list(client.completions.create(model=MODEL, prompt="Hi", n=2, max_tokens=4,
                                            stream=True, temperature=1.0, seed=3))
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1}


def test_seed_reproducibility(client):
    kw = dict(messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=16,
              temperature=1.0)
    texts = [chat(client, seed=1234, **kw).choices[0].message.content for _ in range(2)]
    assert texts[0] == texts[1]
    others = {chat(client, seed=s, **kw).choices[0].message.content for s in (1, 2, 3)}
    assert len(others | {texts[0]}) > 1  # seeds matter


def test_logprobs(client):
    out = chat(client, max_tokens=5, logprobs=True, top_logprobs=2, **GREEDY)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    assert all(t.logprob <= 0 and len(t.top_logprobs) == 2 for t in content)
    assert all(t.top_logprobs[0].logprob >= t.logprob - 1e-4 for t in content)  # greedy = top-1


def test_metrics_after_requests(client, server):
    chat(client, max_tokens=2)
    body = httpx.get(server.url + "/metrics", timeout=10).text
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in body.splitlines()
              if line and not line.startswith("#")}
    assert values["moeserve:prompt_tokens_total"] > 0
    assert values["moeserve:generation_tokens_total"] > 0
    assert values["moeserve:time_to_first_token_seconds_count"] > 0
    assert values["moeserve:e2e_request_latency_seconds_count"] > 0
    assert 'moeserve:num_running_reqs{rank="0"}' in values
    assert 'moeserve:kv_cache_usage_ratio{rank="0"}' in values


def test_server_info_and_flush_cache(server):
    info = httpx.get(server.url + "/server_info", timeout=30).json()
    assert info["served_model_name"] == MODEL and info["max_req_len"] > 0
    assert info["ready"]["scheduler:0"]["max_total_tokens"] > 0
    weights = info["ready"]["scheduler:0"]["weight_bytes"]  # this rank's, by part
    assert weights["total"] == sum(weights[k] for k in ("attention", "mlp", "experts",
                                                        "embeddings", "other")) > 0
    assert httpx.post(server.url + "/flush_cache", timeout=30).json()["ok"] is True
