"""Prefill-decode disaggregation end to end: SGLang's own router (`sglang_router.launch_router
--pd-disaggregation`, PyPI `sglang-router`) in front of moeserve prefill and decode servers, KV
moved by the Mooncake transfer engine (TCP on this CPU).

Oracle: the same request sent to the prefill server without bootstrap fields, which serves it
colocated (prefill and decode on its own ranks, KV never leaves it): greedy tokens must be equal
token for token. Two pairs, started together once for the module:
- tiny Qwen3-MoE (GQA pool): a DP2 prefill (context 192) in front of a DP1 decode server running
  the overlap loop (context 256), each started here, with the router started here;
- tiny DeepSeek-V3 (MLA pool) through the one-command launch (`launch.multinode +cluster=local
  +deploy=pd_tiny_cpu`): a DP1 prefill and a DP2 decode server (page size 4, overlap loop), both
  speculating with the checkpoint's MTP layer (`make_tiny(draftable=True)`: a layer whose drafts
  the target often accepts); the last test stops it with SIGTERM.
"""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import pytest
from live_server import LiveServer, free_port
from pd_support import Deployment, Router, require_mooncake

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

BASE = ["device=cpu", "model.dtype=float32", "scheduler.cpu_threads=1",
        "server.startup_timeout_s=300"]
SPEC = ["spec=nextn", "spec.max_batch_size=0"]
PROMPTS = ["Once upon a time", "The capital of France is", "Once upon a time"]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


@dataclass
class PD:
    qwen_p: LiveServer
    qwen_d: LiveServer
    qwen_boot: int
    qwen: Router
    dsv3: Deployment


@pytest.fixture(scope="module")
def pd(tiny_model):
    """Everything starts at once; the routers once their servers are up."""
    require_mooncake()
    qwen, dsv3 = tiny_model("qwen3_moe"), tiny_model("deepseek_v3", draftable=True)
    boot = free_port()
    qwen_p = LiveServer([f"model.path={qwen}", *BASE, "model.context_length=192",
                         "disaggregation=prefill", f"disaggregation.bootstrap_port={boot}",
                         "parallel=dp2_ep2"])
    qwen_d = LiveServer([f"model.path={qwen}", *BASE, "model.context_length=256",
                         "disaggregation=decode", "disaggregation.heartbeat_interval_s=0.3",
                         "scheduler.overlap=true"])
    deploy = Deployment([f"model.path={dsv3}", "model.context_length=256",
                         "server.startup_timeout_s=300",
                         _list("prefill_overrides", SPEC),
                         _list("decode_overrides", ["parallel=dp2_ep2", "cache.page_size=4",
                                                    "scheduler.overlap=true", *SPEC])])
    router = None
    try:
        qwen_p.wait_healthy()
        qwen_d.wait_healthy()
        router = Router(qwen_p.url, boot, qwen_d.url).wait()
        yield PD(qwen_p, qwen_d, boot, router, deploy.wait())
    finally:
        if router is not None:
            router.stop()
        deploy.stop()
        qwen_p.stop()
        qwen_d.stop()


def _list(key: str, overrides: list[str]) -> str:
    return f"disaggregation.{key}=[{','.join(json.dumps(o) for o in overrides)}]"


def generate(url: str, prompt: str, n: int = 8, timeout: float = 120, **extra) -> dict:
    r = httpx.post(url + "/generate", timeout=timeout, json={
        "text": prompt, "sampling_params": {"max_new_tokens": n, "temperature": 0},
        **extra})
    assert r.status_code == 200, r.text
    return r.json()


def ranks(url: str) -> list[dict]:
    return httpx.get(url + "/server_info", timeout=30).json()["ranks"]


def transfers(url: str) -> list[int]:
    """KV transfers per DP rank."""
    return [r.get("disagg", {}).get("transfers", 0) for r in ranks(url)]


def test_qwen_dp2_prefill_to_dp1_decode(pd):
    """Greedy tokens equal the colocated ones; one prompt repeated (the prefill serves it from its
    radix cache and still sends every position). Rooms 0 and 1, sent to both servers as the
    router does, reach both prefill ranks (room % dp_size)."""
    before = transfers(pd.qwen_d.url)
    for prompt in PROMPTS:
        want = generate(pd.qwen_p.url, prompt)["output_ids"]
        assert generate(pd.qwen.url, prompt)["output_ids"] == want, prompt
    p_before = transfers(pd.qwen_p.url)
    for room in (0, 1):
        body = {"text": f"Room {room} says", "bootstrap_host": "127.0.0.1",
                "bootstrap_port": pd.qwen_boot, "bootstrap_room": room,
                "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
        want = generate(pd.qwen_p.url, body["text"], n=6)["output_ids"]
        with ThreadPoolExecutor(2) as pool:
            got = [pool.submit(httpx.post, u + "/generate", json=body, timeout=120)
                   for u in (pd.qwen_p.url, pd.qwen_d.url)]
            got = [f.result() for f in got]
        assert got[1].status_code == 200 and got[1].json()["output_ids"] == want
    p_after = transfers(pd.qwen_p.url)
    assert [a - b for a, b in zip(p_after, p_before)] == [1, 1]
    assert sum(transfers(pd.qwen_d.url)) - sum(before) == len(PROMPTS) + 2
    metrics = httpx.get(pd.qwen_d.url + "/metrics", timeout=30).text
    assert 'moeserve:kv_transfers_total{rank="0",role="decode"}' in metrics
    assert "moeserve:kv_transfer_seconds_total" in metrics


def test_dsv3_mtp_decode_dp2(pd):
    """MLA pool plus the MTP layer's: concurrent requests land on both decode ranks, which
    speculate and give the colocated tokens. The draft's state after the first token (its next
    proposal and hidden state) comes from the prefill, so each request's verify steps and accepted
    tokens equal the colocated server's too (from a stale row state the first round's draft is a
    guess: 2 of these 6 requests then took a verify step more), and drafts are accepted."""
    d = pd.dsv3
    keys = ("spec_verify_steps", "spec_draft_tokens", "spec_accepted_tokens")
    prompts = ["Story number one", "The capital of France is", "Once upon a time",
               "Red green blue", "def main():", "1 2 3 4"]

    def run(url: str, q: str) -> tuple[list[int], tuple[int, ...]]:
        out = generate(url, q, n=16)
        return out["output_ids"], tuple(out["meta_info"][k] for k in keys)

    want = [run(d.prefill, q) for q in prompts]
    with ThreadPoolExecutor(6) as pool:
        got = list(pool.map(lambda q: run(d.url, q), prompts))
    assert [g[0] for g in got] == [w[0] for w in want]
    assert [g[1] for g in got] == [w[1] for w in want]
    steps, accepted = (sum(g[1][k] for g in got) for k in (0, 2))
    assert accepted / steps > 1.5, (accepted, steps)  # tokens per verify step: drafts accepted
    info = ranks(d.decode)
    assert all(r["disagg"]["transfers"] > 0 for r in info), info
    assert not any(r.get("pd_draft_state_missing") for r in info), info


def completion(url: str, **body) -> dict:
    r = httpx.post(url + "/v1/completions", timeout=120, json={"temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_n_and_stop_strings(pd):
    """n=2 gives each sample its own room on both servers; a stop string found by the decode
    server's detokenizer ends the text as it does colocated."""
    p, url = pd.qwen_p.url, pd.qwen.url
    model = httpx.get(p + "/v1/models").json()["data"][0]["id"]  # the router asks for one
    body = {"prompt": "Once upon a time", "max_tokens": 10, "n": 2, "model": model}
    full = completion(p, **body)["choices"][0]["text"]
    stop = full[len(full) // 2: len(full) // 2 + 2]
    want = completion(p, **body, stop=[stop])
    got = completion(url, **body, stop=[stop])
    assert [c["text"] for c in got["choices"]] == [c["text"] for c in want["choices"]]
    assert [c["finish_reason"] for c in got["choices"]] == ["stop", "stop"]


def chat_stream(url: str, **body) -> tuple[str, str]:
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "Tell me a story."}], "temperature": 0,
            "stream": True, **body}) as resp:
        assert resp.status_code == 200
        events = [json.loads(line[6:]) for line in resp.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    assert not [e for e in events if "error" in e], events
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    finish = [e["choices"][0].get("finish_reason") for e in events if e["choices"]][-1]
    return text, finish


def test_streaming_chat(pd):
    for colocated, routed in ((pd.qwen_p.url, pd.qwen.url), (pd.dsv3.prefill, pd.dsv3.url)):
        assert chat_stream(routed, max_tokens=10) == chat_stream(colocated, max_tokens=10)


def test_json_schema(pd):
    """The prefill samples the first token under the grammar; the decode server's matcher accepts
    it before decoding on."""
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}

    def ask(url: str) -> str:
        r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "A person."}], "temperature": 0,
            "max_tokens": 40, "response_format": fmt})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]

    want = ask(pd.qwen_p.url)
    assert ask(pd.qwen.url) == want
    if want.endswith("}"):
        assert set(json.loads(want)) == {"name", "age"}


def test_first_token_logprobs(pd):
    """The first token's logprob and top logprobs (sampled on the prefill) come back through the
    decode server, equal to the colocated ones, as do the later tokens'."""
    extra = {"return_logprob": True, "top_logprobs_num": 3}
    want = generate(pd.qwen_p.url, "Once upon a time", n=4, **extra)["meta_info"]
    got = generate(pd.qwen.url, "Once upon a time", n=4, **extra)["meta_info"]
    assert len(got["output_top_logprobs"]) == 4 and len(got["output_top_logprobs"][0]) == 3
    for key in ("output_token_logprobs", "output_top_logprobs"):
        assert _close(got[key], want[key]), (key, got[key], want[key])


def _close(a, b) -> bool:
    if isinstance(a, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    if isinstance(a, float):
        return abs(a - b) < 1e-4
    return a == b


def test_prefill_refusal_reaches_decode(pd):
    """A prompt the prefill refuses (longer than its context of 192 tokens; the decode's is 256).
    Through the router the client gets the reason. Sent to both servers with the decode's
    connection kept open (the router may drop it at once): the decode's own answer ends with the
    prefill's reason, where without word from the prefill it would wait waiting_timeout_s (120 s,
    beyond this request's 60 s timeout), and its reserved slots are free again."""
    d, text = pd.qwen_d.url, "A long prompt " * 70
    used0 = _used(d)
    r = httpx.post(pd.qwen.url + "/generate", timeout=60, json={
        "text": text, "sampling_params": {"max_new_tokens": 4}})
    assert r.status_code >= 400 and "maximum context length is 192" in r.text, r.text
    body = {"text": text, "bootstrap_host": "127.0.0.1", "bootstrap_port": pd.qwen_boot,
            "bootstrap_room": 7, "sampling_params": {"max_new_tokens": 4}}
    with ThreadPoolExecutor(2) as pool:
        decode = pool.submit(httpx.post, d + "/generate", json=body, timeout=60)
        failures0 = sum(r["disagg"]["failures"] for r in ranks(d))
        _wait_waiting_for_kv(d, 1, failures0)  # the decode has reserved the room's slots
        assert httpx.post(pd.qwen_p.url + "/generate", json=body, timeout=60).status_code == 400
        got = decode.result()
    assert "maximum context length is 192" in got.text, got.text
    deadline = time.monotonic() + 10
    while _used(d) != used0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _used(d) == used0


def _used(url: str) -> list[int]:
    return [r["used_tokens"] for r in ranks(url)]


def test_prefill_killed_under_load(pd):
    """32 streams; the prefill server is SIGKILLed while the last 16 wait for its KV: each
    request either completes with the colocated tokens or ends with an error (no third outcome),
    requests already decoding all complete, and the decode pool's used slots return to where they
    were. The prefill's front process is stopped (SIGSTOP) before the last 16 are sent, so that
    the kill finds them in flight however fast the machine (a fixed sleep let a fast one finish
    them first). Ends the Qwen prefill server."""
    p, d, url = pd.qwen_p, pd.qwen_d, pd.qwen.url
    prompts = [f"Request {i} says" for i in range(32)]
    with ThreadPoolExecutor(16) as pool:  # long enough to be decoding when the prefill dies
        want = dict(zip(prompts, pool.map(lambda q: generate(p.url, q, n=100)["output_ids"],
                                          prompts[:16])))
    used0 = _used(d.url)

    def run(q: str, n: int) -> tuple[str, list[int] | None, str | None]:
        try:
            return q, generate(url, q, n=n)["output_ids"], None
        except (AssertionError, httpx.HTTPError) as e:
            return q, None, str(e)

    with ThreadPoolExecutor(32) as pool:
        early = [pool.submit(run, q, 100) for q in prompts[:16]]
        _wait_decoding(d.url, 16)
        failures0 = sum(r["disagg"]["failures"] for r in ranks(d.url))
        os.kill(p.proc.pid, signal.SIGSTOP)
        late = [pool.submit(run, q, 16) for q in prompts[16:]]
        _wait_waiting_for_kv(d.url, 16, failures0)
        p.proc.kill()
        results = [f.result() for f in early + late]
    for q, ids, err in results[:16]:
        assert err is None and ids == want[q], (q, err)
    errors = [err for _, ids, err in results[16:] if err is not None]
    assert all(ids is not None and len(ids) == 16 for _, ids, err in results[16:] if err is None)
    assert errors, "killing the prefill left every late request unharmed: the test missed"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        info = ranks(d.url)
        if [r["used_tokens"] for r in info] == used0 and all(r["running"] == 0 for r in info):
            break
        time.sleep(0.5)
    assert [r["used_tokens"] for r in info] == used0, info
    assert sum(r["disagg"]["failures"] for r in info) >= 1
    assert generate(d.url, "still serving")["output_ids"]  # colocated requests still work


def _wait_waiting_for_kv(url: str, n: int, failures0: int, timeout: float = 60) -> None:
    """Until `n` requests wait at the decode server for their KV (or have failed waiting)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = ranks(url)
        if sum(r["disagg"]["in_flight"] + r["disagg"]["failures"] for r in info) - failures0 >= n:
            return
        time.sleep(0.05)
    pytest.fail(f"the last {n} requests never reached the decode server: {info}")


def _wait_decoding(url: str, n: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sum(r["running"] for r in ranks(url)) >= n:
            return
        time.sleep(0.05)
    pytest.fail("the first 16 requests never all decoded")


def test_one_command_launch_stops_cleanly(pd):
    """SIGTERM to `launch.multinode` stops the router and both servers (SIGTERM first: they drain)
    and it exits 0; nothing listens on their ports after."""
    d = pd.dsv3
    assert d.stop(timeout=60) == 0, d.tail()
    for url in (d.url, d.prefill, d.decode):
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/health", timeout=5)
