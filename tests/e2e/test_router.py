"""sglang-router (PyPI `sglang-router`, regular mode) in front of two servers: the router's own
requests (its HTTP/2 probe, /model_info, health checks) and a client's through it (chat without
`model`, completions, /generate, streaming) all work, both servers serve some, and no server logs a
warning for the router's probes. Policies: round_robin, and cache_aware (its prefix affinity lands
repeats on the server that caches them)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time

import httpx
import pytest
from live_server import LiveServer, free_port

pytest.importorskip("sglang_router", reason="sglang-router (PyPI) does not install here")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SERVER = ["device=cpu", "model.dtype=float32", "model.context_length=256",
          "scheduler.cpu_threads=1"]
CHAT = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def routed(tiny_model):
    """(router URL, [server, server]); the router waits until both workers are active."""
    path = tiny_model("llama")
    servers = [LiveServer([f"model.path={path}", *SERVER]) for _ in range(2)]
    for s in servers:
        s.wait_healthy()
    try:
        with _router(servers, "round_robin") as url:
            yield url, servers
    finally:
        for s in servers:
            s.stop()


@contextlib.contextmanager
def _router(servers: list[LiveServer], policy: str):
    """sglang-router in regular mode (`--worker-urls`) with `policy`; → its URL once it serves."""
    port = free_port()
    log = tempfile.NamedTemporaryFile("w+", prefix="router-", suffix=".log", delete=False)
    router = subprocess.Popen(
        [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls",
         *[s.url for s in servers], "--host", "127.0.0.1", "--port", str(port),
         "--policy", policy, "--prometheus-port", str(free_port())],
        stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_for_workers(url, router, log.name)
        yield url
    finally:
        router.terminate()
        router.wait(30)
        os.unlink(log.name)


def _wait_for_workers(url: str, router: subprocess.Popen, log: str, timeout: float = 90) -> None:
    """Until a chat through the router succeeds on both workers (they register asynchronously)."""
    deadline, served = time.monotonic() + timeout, 0
    while time.monotonic() < deadline and served < 2:
        if router.poll() is not None:
            pytest.fail(f"router exited {router.returncode}: {open(log).read()[-3000:]}")
        try:
            r = httpx.post(url + "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1},
                           timeout=30)
            served = served + 1 if r.status_code == 200 else 0
        except httpx.HTTPError:
            pass
        if served < 2:
            time.sleep(0.5)
    if served < 2:
        pytest.fail(f"router never served: {open(log).read()[-3000:]}")


def prompt_tokens(server: LiveServer) -> int:
    info = httpx.get(server.url + "/server_info", timeout=30).json()
    return sum(r.get("prompt_tokens", 0) for r in info["ranks"])


def test_requests_through_the_router(routed):
    url, servers = routed
    before = [prompt_tokens(s) for s in servers]
    chat = httpx.post(url + "/v1/chat/completions", timeout=60,
                      json={"messages": CHAT, "max_tokens": 4, "temperature": 0})
    assert chat.status_code == 200, chat.text  # no `model`: the router sends "unknown"
    assert chat.json()["choices"][0]["message"]["content"]
    name = httpx.get(servers[0].url + "/v1/models").json()["data"][0]["id"]
    comp = httpx.post(url + "/v1/completions", timeout=60,
                      json={"model": name, "prompt": "Once", "max_tokens": 4})
    assert comp.status_code == 200 and comp.json()["usage"]["completion_tokens"] == 4
    gen = httpx.post(url + "/generate", timeout=60,
                     json={"text": "Once", "sampling_params": {"max_new_tokens": 3}})
    assert gen.status_code == 200 and len(gen.json()["output_ids"]) == 3
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=60, json={
            "messages": CHAT, "max_tokens": 5, "stream": True, "ignore_eos": True}) as resp:
        events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert resp.status_code == 200 and events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    for _ in range(4):  # round robin: the next few land on both servers
        httpx.post(url + "/generate", timeout=60,
                   json={"text": "Twice", "sampling_params": {"max_new_tokens": 1}})
    after = [prompt_tokens(s) for s in servers]
    assert all(a > b for a, b in zip(after, before)), (before, after)


def test_router_probes_leave_no_warnings(routed):
    """The router's HTTP/2 prior-knowledge probe used to log uvicorn's `Invalid HTTP request
    received.` twice per worker; /model_info used to be a 404."""
    import socket

    _, servers = routed
    with socket.create_connection(("127.0.0.1", servers[0].port), timeout=10) as sock:
        sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")  # one more probe, by hand
        assert sock.recv(64).startswith(b"HTTP/1.1 400")
    time.sleep(0.5)
    for s in servers:
        log = s.log_tail(1 << 20)
        assert "Invalid HTTP request" not in log
        assert httpx.get(s.url + "/model_info").status_code == 200
    raw = httpx.post(servers[0].url + "/v1/chat/completions", timeout=60,
                     json={"messages": CHAT, "max_tokens": 1, "model": "unknown"})
    assert raw.status_code == 200


def test_cache_aware_policy(routed):
    """`--policy cache_aware` over the same two servers: a repeated long prompt goes where its
    prefix is cached (the router's own prefix tree), so one server serves every repeat and its
    radix cache answers the prompt (cached_tokens), while both servers stay in rotation for
    unrelated prompts."""
    _, servers = routed
    prompt = "A long shared prefix about the history of the printing press. " * 4
    with _router(servers, "cache_aware") as url:
        before = [prompt_tokens(s) for s in servers]
        cached = []
        for _ in range(4):
            r = httpx.post(url + "/generate", timeout=60, json={
                "text": prompt, "sampling_params": {"max_new_tokens": 1}})
            assert r.status_code == 200, r.text
            cached.append(r.json()["meta_info"]["cached_tokens"])
        grew = [prompt_tokens(s) - b for s, b in zip(servers, before)]
    assert sorted(g > 0 for g in grew) == [False, True], grew  # one server took all four
    assert all(c > 0 for c in cached[1:]), cached
