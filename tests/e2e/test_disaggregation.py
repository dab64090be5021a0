"""Prefill-decode disaggregation end to end: SGLang's own router (`sglang_router.launch_router
--pd-disaggregation`, PyPI `sglang-router`) in front of moeserve prefill and decode servers, KV
moved by the Mooncake transfer engine (TCP on this CPU).

Oracle: the same request sent to the prefill server without bootstrap fields, which serves it
colocated (prefill and decode on its own ranks, KV never leaves it): greedy tokens must be equal
token for token. Tiny random Qwen3-MoE (GQA pool) and DeepSeek-V3 (MLA latent pool), float32.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from live_server import LiveServer, free_port
from pd_support import require_mooncake

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

BASE = ["device=cpu", "model.dtype=float32", "model.context_length=256",
        "scheduler.cpu_threads=1", "server.startup_timeout_s=300"]
PROMPTS = ["Once upon a time", "The capital of France is", "def fib(n):", "Once upon a time"]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


class Router:
    """sglang-router in PD mode over one prefill and one decode server."""

    def __init__(self, prefill: LiveServer, bootstrap_port: int, decode: LiveServer):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="pd-router-", suffix=".log")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
             "--prefill", prefill.url, str(bootstrap_port), "--decode", decode.url,
             "--host", "127.0.0.1", "--port", str(self.port), "--prometheus-port",
             str(free_port())], stdout=self.log, stderr=subprocess.STDOUT)

    def wait(self, timeout: float = 60) -> Router:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.tail()
            try:
                r = httpx.post(self.url + "/generate", timeout=30, json={
                    "text": "warm", "sampling_params": {"max_new_tokens": 1}})
                if r.status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        pytest.fail(f"router never served: {self.tail()}")

    def tail(self) -> str:
        self.log.seek(0)
        return self.log.read()[-3000:]

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        self.log.close()


@pytest.fixture(scope="module")
def pd(tiny_model):
    """Servers (started together), then one router per (prefill, decode) pairing."""
    require_mooncake()
    qwen, dsv3 = tiny_model("qwen3_moe"), tiny_model("deepseek_v3")
    ports = {k: free_port() for k in ("qwen", "dsv3")}

    def prefill(path: str, port: int) -> LiveServer:
        return LiveServer([f"model.path={path}", *BASE, "disaggregation=prefill",
                           f"disaggregation.bootstrap_port={port}"])

    def decode(path: str, *extra: str) -> LiveServer:
        return LiveServer([f"model.path={path}", *BASE, "disaggregation=decode",
                           "disaggregation.heartbeat_interval_s=0.3", *extra])

    servers = {"qwen_p": prefill(qwen, ports["qwen"]), "qwen_d": decode(qwen),
               "qwen_d2": decode(qwen, "parallel=dp2_ep2", "cache.page_size=4"),
               "dsv3_p": prefill(dsv3, ports["dsv3"]), "dsv3_d": decode(dsv3)}
    routers: list[Router] = []
    try:
        for s in servers.values():
            s.wait_healthy()
        pairs = {"qwen": ("qwen_p", "qwen", "qwen_d"), "qwen_dp2": ("qwen_p", "qwen", "qwen_d2"),
                 "dsv3": ("dsv3_p", "dsv3", "dsv3_d")}
        for p, port, d in pairs.values():
            routers.append(Router(servers[p], ports[port], servers[d]))
        by_name = {name: r.wait() for name, r in zip(pairs, routers)}
        yield servers, by_name
    finally:
        for r in routers:
            r.stop()
        for s in servers.values():
            s.stop()


def generate(url: str, prompt: str, n: int = 12, **extra) -> dict:
    r = httpx.post(url + "/generate", timeout=120, json={
        "text": prompt, "sampling_params": {"max_new_tokens": n, "temperature": 0, **extra}})
    assert r.status_code == 200, r.text
    return r.json()


def transfers(server: LiveServer) -> tuple[int, int, int]:
    ranks = httpx.get(server.url + "/server_info", timeout=30).json()["ranks"]
    totals = [sum(r.get("disagg", {}).get(k, 0) for r in ranks)
              for k in ("transfers", "bytes", "failures")]
    return tuple(totals)


@pytest.mark.parametrize("model", ["qwen", "dsv3"])
def test_greedy_tokens_equal_colocated(pd, model):
    """Several prompts, one repeated (the prefill serves it from its radix cache and still sends
    every position's KV), decoded by the decode server from the prefill's first token on."""
    servers, routers = pd
    p, d = servers[f"{model}_p"], servers[f"{model}_d"]
    before = transfers(d)
    for prompt in PROMPTS:
        want = generate(p.url, prompt)["output_ids"]
        got = generate(routers[model].url, prompt)["output_ids"]
        assert got == want, (prompt, got, want)
    after = transfers(d)
    assert after[0] - before[0] == len(PROMPTS) and after[1] > before[1], (before, after)
    assert transfers(p)[0] >= len(PROMPTS)
    metrics = httpx.get(d.url + "/metrics", timeout=30).text
    assert 'moeserve:kv_transfers_total{rank="0",role="decode"}' in metrics
    assert "moeserve:kv_transfer_seconds_total" in metrics


def completion(url: str, **body) -> dict:
    r = httpx.post(url + "/v1/completions", timeout=120, json={"temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_n_and_stop_strings(pd):
    """n=2 gives each sample its own room on both servers; a stop string found by the decode
    server's detokenizer ends the text as it does colocated."""
    servers, routers = pd
    p, url = servers["qwen_p"], routers["qwen"].url
    model = httpx.get(p.url + "/v1/models").json()["data"][0]["id"]  # the router asks for one
    body = {"prompt": "Once upon a time", "max_tokens": 10, "n": 2, "model": model}
    full = completion(p.url, **body)["choices"][0]["text"]
    stop = full[len(full) // 2: len(full) // 2 + 2]
    want = completion(p.url, **body, stop=[stop])
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
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    finish = [e["choices"][0].get("finish_reason") for e in events if e["choices"]][-1]
    return text, finish


@pytest.mark.parametrize("model", ["qwen", "dsv3"])
def test_streaming_chat(pd, model):
    servers, routers = pd
    want = chat_stream(servers[f"{model}_p"].url, max_tokens=12)
    assert chat_stream(routers[model].url, max_tokens=12) == want


def test_json_schema(pd):
    """The prefill samples the first token under the grammar; the decode server's matcher accepts
    it before decoding on."""
    servers, routers = pd
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}

    def ask(url: str) -> str:
        r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "A person."}], "temperature": 0,
            "max_tokens": 40, "response_format": fmt})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]

    want = ask(servers["qwen_p"].url)
    assert ask(routers["qwen"].url) == want
    if want.endswith("}"):
        assert set(json.loads(want)) == {"name", "age"}


def test_decode_dp2(pd):
    """A DP1 prefill in front of a DP2 decode server (page size 4): concurrent requests land on
    both decode ranks and match."""
    servers, routers = pd
    prompts = [f"Story number {i}:" for i in range(6)]
    want = [generate(servers["qwen_p"].url, q)["output_ids"] for q in prompts]
    with ThreadPoolExecutor(6) as pool:
        got = list(pool.map(lambda q: generate(routers["qwen_dp2"].url, q)["output_ids"],
                            prompts))
    assert got == want
    ranks = httpx.get(servers["qwen_d2"].url + "/server_info", timeout=30).json()["ranks"]
    assert all(r["disagg"]["transfers"] > 0 for r in ranks), ranks


def test_prefill_killed_under_load(pd):
    """32 streams; the prefill server is SIGKILLed while the last 16 are being prefilled: each
    request either completes with the colocated tokens or ends with an error (no third outcome),
    requests already decoding all complete, and the decode pool's used slots return to where they
    were. Runs last: it ends the Qwen prefill server."""
    servers, routers = pd
    p, d, url = servers["qwen_p"], servers["qwen_d"], routers["qwen"].url
    prompts = [f"Request {i} says" for i in range(32)]
    with ThreadPoolExecutor(16) as pool:  # long enough to be decoding when the prefill dies
        want = dict(zip(prompts, pool.map(lambda q: generate(p.url, q, n=200)["output_ids"],
                                          prompts[:16])))
    used0 = [r["used_tokens"] for r in httpx.get(d.url + "/server_info").json()["ranks"]]

    def run(q: str, n: int) -> tuple[str, list[int] | None, str | None]:
        try:
            out = generate(url, q, n=n)
            return q, out["output_ids"], None
        except (AssertionError, httpx.HTTPError) as e:
            return q, None, str(e)

    with ThreadPoolExecutor(32) as pool:
        early = [pool.submit(run, q, 200) for q in prompts[:16]]
        _wait_decoding(d, 16)
        late = [pool.submit(run, q, 24) for q in prompts[16:]]
        time.sleep(0.3)
        p.proc.kill()
        results = [f.result() for f in early + late]
    for q, ids, err in results[:16]:
        assert err is None and ids == want[q], (q, err)
    errors = [err for _, ids, err in results[16:] if err is not None]
    assert all(ids is not None and len(ids) == 24 for _, ids, err in results[16:] if err is None)
    assert errors, "killing the prefill left every late request unharmed: the test missed"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        ranks = httpx.get(d.url + "/server_info").json()["ranks"]
        if [r["used_tokens"] for r in ranks] == used0 and all(r["running"] == 0 for r in ranks):
            break
        time.sleep(0.5)
    assert [r["used_tokens"] for r in ranks] == used0, ranks
    assert sum(r["disagg"]["failures"] for r in ranks) >= 1
    assert generate(d.url, "still serving")["output_ids"]  # colocated requests still work


def _wait_decoding(d: LiveServer, n: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ranks = httpx.get(d.url + "/server_info").json()["ranks"]
        if sum(r["running"] for r in ranks) >= n:
            return
        time.sleep(0.05)
    pytest.fail("the first 16 requests never all decoded")
