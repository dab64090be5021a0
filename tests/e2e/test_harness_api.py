"""Issue 45 through the official `openai` client on a live float32 SmolLM2 server (shared, see
shared_servers.SMOLLM2_TOOLS_ARGS): prompt logprobs (echo + logprobs with max_tokens 0, vLLM's
prompt_logprobs, /generate's logprob_start_len) against transformers' log_softmax on the same
weights; logprob bytes of tokens that are partial UTF-8; the SDK's two-turn tool loop; the
router's model name and /model_info."""

from __future__ import annotations

import httpx
import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MODEL = "smollm2-135m-instruct"
PROMPTS = ["The capital of France is Paris, and the capital of Italy is",
           "def add(a, b):\n    return"]
TOL = 1e-4


@pytest.fixture(scope="module")
def server(smollm2_tools_server):
    return smollm2_tools_server


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(api_key="unused", base_url=server.url + "/v1", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def hf():
    """(tokenizer, prompt -> (ids, log-probs [L, V])) from transformers on the same weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from moeserve.models.embedded import embedded_model_path

    path = embedded_model_path()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)

    def logprobs(text: str) -> tuple[list[int], torch.Tensor]:
        ids = tok(text)["input_ids"]
        with torch.no_grad():
            return ids, torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)

    return tok, logprobs


def test_echo_logprobs_with_max_tokens_zero(client, hf):
    """What lm-eval's local-completions sends for loglikelihood requests (max_tokens 0 here,
    1 there): every prompt token's logprob and its top alternatives, the prompt echoed."""
    tok, logprobs = hf
    out = client.completions.create(model=MODEL, prompt=PROMPTS, echo=True, logprobs=2,
                                    max_tokens=0)
    assert out.usage.completion_tokens == 0
    for text, choice in zip(PROMPTS, out.choices):
        ids, logp = logprobs(text)
        lp = choice.logprobs
        assert choice.text == text and choice.finish_reason == "length"
        assert lp.tokens == [tok.convert_tokens_to_string([t]) for t in
                             tok.convert_ids_to_tokens(ids)]
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        want = [logp[i - 1, ids[i]].item() for i in range(1, len(ids))]
        assert max(abs(a - b) for a, b in zip(lp.token_logprobs[1:], want)) < TOL
        for i in range(1, len(ids)):
            best = logp[i - 1].topk(2)
            names = [tok.decode([t]) for t in best.indices.tolist()]
            assert list(lp.top_logprobs[i]) == names
            assert abs(lp.top_logprobs[i][names[0]] - best.values[0].item()) < TOL
        assert lp.text_offset[-1] == text.rindex(lp.tokens[-1])


def test_echo_then_one_token_and_streamed(client, hf):
    """max_tokens 1 (lm-eval's own setting): the prompt's entries, then the sampled token's;
    streamed, the first chunk carries the echo and its logprobs."""
    _, logprobs = hf
    ids, logp = logprobs(PROMPTS[0])
    whole = client.completions.create(model=MODEL, prompt=[ids], echo=True, logprobs=1,
                                      max_tokens=1, temperature=0).choices[0]
    assert len(whole.logprobs.token_logprobs) == len(ids) + 1
    nxt = int(logp[-1].argmax())
    assert abs(whole.logprobs.token_logprobs[-1] - logp[-1, nxt].item()) < TOL
    chunks = list(client.completions.create(model=MODEL, prompt=[ids], echo=True, logprobs=1,
                                            max_tokens=3, temperature=0, stream=True))
    first = chunks[0].choices[0]
    assert first.text == PROMPTS[0] and first.logprobs.token_logprobs[0] is None
    assert first.logprobs.token_logprobs[1:] == pytest.approx(whole.logprobs.token_logprobs[1:-1],
                                                              abs=TOL)
    assert "".join(c.choices[0].text for c in chunks if c.choices).startswith(
        PROMPTS[0] + whole.text[len(PROMPTS[0]):])


def test_vllm_prompt_logprobs_and_generate_logprob_start_len(client, server, hf):
    _, logprobs = hf
    ids, logp = logprobs(PROMPTS[1])
    out = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=1, temperature=0,
                                    extra_body={"prompt_logprobs": 1})
    entries = out.choices[0].model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids)
    for i in range(1, len(ids)):
        mine = entries[i][str(ids[i])]
        rank = int((logp[i - 1] > logp[i - 1, ids[i]]).sum()) + 1
        assert abs(mine["logprob"] - logp[i - 1, ids[i]].item()) < TOL and mine["rank"] == rank
    start = 3
    body = {"input_ids": ids, "return_logprob": True, "logprob_start_len": start,
            "top_logprobs_num": 2, "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    meta = httpx.post(server.url + "/generate", json=body, timeout=60).json()["meta_info"]
    got = meta["input_token_logprobs"]
    assert [t for _, t, _ in got] == ids[start:]
    assert max(abs(v - logp[i - 1, ids[i]].item())
               for i, (v, _, _) in zip(range(start, len(ids)), got)) < TOL
    top = logp[start - 1].topk(2).indices.tolist()
    assert [t for _, t, _ in meta["input_top_logprobs"][0]] == top
    assert len(meta["output_token_logprobs"]) == 2 and len(meta["output_top_logprobs"][0]) == 2


def test_logprob_bytes_of_partial_utf8_tokens(client):
    """A reply forced (regex) to two emoji: SmolLM2 spells them with tokens that each hold part
    of a character; `bytes` are those tokens' own bytes, and they join to the reply's UTF-8."""
    reply = "😊🚀"
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Two emoji, please."}],
        temperature=0, max_tokens=12, logprobs=True, top_logprobs=2, extra_body={"regex": reply})
    content = out.choices[0].logprobs.content
    assert out.choices[0].message.content == reply
    joined = b"".join(bytes(t.bytes) for t in content)  # the stop token's entry comes last
    assert joined.removesuffix(b"<|im_end|>") == reply.encode()
    partial = [t for t in content if not _decodes(bytes(t.bytes))]
    assert partial and all("\\x" in t.token and "\ufffd" not in t.token for t in partial)
    assert all(bytes(t.bytes) != "\ufffd".encode() for t in content)


def _decodes(b: bytes) -> bool:
    try:
        b.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


def test_sdk_two_turn_tool_loop(client, server):
    """The loop as the SDK's documentation writes it: the reply's message appended as is
    (content None, string arguments), then the tool's result; the second turn is served and its
    prompt shows the call (in the Hermes format SmolLM2 was told) and the result."""
    import json

    import openai

    sent: list[bytes] = []
    spy = openai.OpenAI(api_key="unused", base_url=server.url + "/v1", timeout=120,
                        max_retries=0, http_client=httpx.Client(
                            event_hooks={"request": [lambda r: sent.append(r.read())]}))
    messages: list = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = spy.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER],
                                        tool_choice="required", temperature=0, max_tokens=40)
    call = first.choices[0].message.tool_calls[0]
    messages.append(first.choices[0].message)
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "21 C and sunny"})
    second = spy.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER],
                                         temperature=0, max_tokens=16)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    body = json.loads(sent[-1])
    assert body["messages"][1]["content"] is None  # what used to fail the template
    ids = httpx.post(server.url + "/tokenize", json={"messages": body["messages"]},
                     timeout=30).json()["tokens"]
    prompt = httpx.post(server.url + "/detokenize", json={"tokens": ids}).json()["prompt"]
    assert f'<tool_call>{{"name": "get_weather", "arguments": {call.function.arguments}}}' \
           f'</tool_call>' in prompt
    assert prompt.index("</tool_call>") < prompt.index("21 C and sunny")


def test_router_default_model_name_and_model_info(client, server):
    out = client.chat.completions.create(model="unknown", max_tokens=2,
                                         messages=[{"role": "user", "content": "Hi"}])
    assert out.model == MODEL  # the router's placeholder is this server's model
    info = httpx.get(server.url + "/model_info").json()
    assert info["served_model_name"] == MODEL and info["is_generation"] is True
    assert info["architectures"] == ["LlamaForCausalLM"]
    assert httpx.get(server.url + "/get_model_info").json() == info
