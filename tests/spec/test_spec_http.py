"""The HTTP server with speculative decoding (tiny DeepSeek-V3, its MTP layer as the draft),
through the official openai client: streamed and non-streamed chats give the plain Engine's texts,
n > 1 and stop strings keep working, `usage` carries the spec_decoding extension and /metrics the
speculative counters."""

from __future__ import annotations

import httpx
import openai
import pytest
from live_server import LiveServer, assert_concurrent_chats_match_engine
from parity import FP32_CPU

from moeserve import Engine

SPEC = ["spec.algorithm=nextn", "spec.max_batch_size=0", "spec.num_steps=3"]
QUESTIONS = [f"Question {i}: {'tell me something ' * (i % 3 + 1)}" for i in range(6)]


@pytest.fixture(scope="module")
def spec_server(tiny_model):
    path = tiny_model("deepseek_v3")
    live = LiveServer([f"model.path={path}", *FP32_CPU, *SPEC]).wait_healthy()
    yield live, path
    live.stop(keep_log=live.proc.returncode not in (None, 0, 1))


@pytest.fixture(scope="module")
def plain_engine(spec_server):
    """The plain Engine (no speculation) on the same checkpoint: the oracle of both tests."""
    with Engine(spec_server[1], FP32_CPU) as eng:
        yield eng


@pytest.mark.timeout(300)
def test_concurrent_chats_equal_plain_engine(spec_server, plain_engine):
    live, path = spec_server
    assert_concurrent_chats_match_engine(live.url, path, QUESTIONS, [3, 9, 14, 6, 11, 1],
                                         FP32_CPU, engine=plain_engine)


@pytest.mark.timeout(300)
def test_stream_n_stop_and_usage(spec_server, plain_engine):
    live, _ = spec_server
    client = openai.OpenAI(api_key="unused", base_url=live.url + "/v1", timeout=120,
                           max_retries=0)
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": QUESTIONS[2]}]
    chat = plain_engine.apply_chat_template(messages)
    plain = plain_engine.generate(input_ids=[chat], sampling_params={
        "temperature": 0, "ignore_eos": True, "max_new_tokens": 16})[0]["text"]
    full = client.chat.completions.create(model=model, messages=messages, temperature=0,
                                          max_tokens=16, n=2, extra_body={"ignore_eos": True})
    assert [c.message.content for c in full.choices] == [plain, plain]
    spec = full.usage.model_extra["spec_decoding"]
    assert spec["verify_steps"] >= 2 * 5 and spec["accepted_tokens"] >= spec["verify_steps"]
    assert spec["accept_length"] == pytest.approx(spec["accepted_tokens"] / spec["verify_steps"],
                                                  abs=1e-3)
    chunks = client.chat.completions.create(model=model, messages=messages, temperature=0,
                                            max_tokens=16, stream=True,
                                            extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == plain
    if len(plain) > 6:  # a stop string inside the text ends it there (excluded, as OpenAI does)
        stop = plain[3:6]
        cut = client.chat.completions.create(model=model, messages=messages, temperature=0,
                                             max_tokens=16, stop=[stop],
                                             extra_body={"ignore_eos": True})
        assert cut.choices[0].message.content == plain[: plain.index(stop)]
    metrics = httpx.get(live.url + "/metrics", timeout=10).text
    verify = [line for line in metrics.splitlines()
              if line.startswith("moeserve:spec_verify_steps_total")]
    assert verify and float(verify[0].split()[-1]) >= spec["verify_steps"]
