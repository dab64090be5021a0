"""Slow clients against a live server (tiny Llama with a 4k context, fp32): one raw socket that
sends a long streaming completion and never reads (its receive buffer fills, so the server's
writes wait), and one that reads a little now and then. Meanwhile other streams and /health are
served in normal time, and once the slow sockets close their generations are aborted and the
server is back to its baseline."""

from __future__ import annotations

import fcntl
import json
import socket
import struct
import termios
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from live_server import LiveServer

import httpx
from moeserve.tools.fuzz_api import check_baseline

openai = pytest.importorskip("openai")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

SLOW_TOKENS = 4000  # ~25 s of decoding here: far longer than the test keeps the sockets open


@pytest.fixture(scope="module")
def server(tiny_model):
    path = tiny_model("llama", max_position_embeddings=4096)
    live = LiveServer([f"model.path={path}", "model.dtype=float32",
                       "server.served_model_name=m"]).wait_healthy()
    yield live
    live.stop()


def slow_socket(server: LiveServer) -> socket.socket:
    """A streaming completion sent on a raw socket with a 4 kB receive buffer; nothing read."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", server.port))
    body = json.dumps({"model": "m", "prompt": "Once upon a time", "max_tokens": SLOW_TOKENS,
                       "temperature": 0, "stream": True, "ignore_eos": True}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json"
                 b"\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    return sock


def unread_bytes(sock: socket.socket) -> int:
    return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]


def timed_stream(server: LiveServer, max_tokens: int = 64) -> float:
    """Seconds for one greedy completion stream of `max_tokens` through the openai client."""
    client = openai.OpenAI(api_key="unused", base_url=server.url + "/v1", timeout=60,
                           max_retries=0)
    t0 = time.monotonic()
    stream = client.completions.create(
        model="m", prompt="The weather today", max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == max_tokens
    return time.monotonic() - t0


def running(server: LiveServer) -> int:
    return sum(r["running"] for r in httpx.get(server.url + "/server_info", timeout=10)
               .json()["ranks"])


def test_slow_clients_do_not_block_others(server):
    baseline = max(timed_stream(server) for _ in range(3))
    stalled, trickle = slow_socket(server), slow_socket(server)
    stop = threading.Event()

    def read_slowly() -> None:  # 512 bytes every 0.2 s: far slower than the tokens come
        while not stop.wait(0.2):
            trickle.recv(512)

    reader = threading.Thread(target=read_slowly, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 30
        while unread_bytes(stalled) < 2048 or running(server) < 2:  # buffer filling, both run
            assert time.monotonic() < deadline, (unread_bytes(stalled), running(server))
            time.sleep(0.2)
        with ThreadPoolExecutor(3) as pool:
            loaded = [f.result() for f in [pool.submit(timed_stream, server) for _ in range(6)]]
        assert httpx.get(server.url + "/health", timeout=5).status_code == 200
        full = unread_bytes(stalled)
        time.sleep(1.0)
        assert unread_bytes(stalled) == full  # the server's writes to it wait (backpressure)
        assert running(server) == 2  # both slow generations still running: none finished early
        print(f"slow clients: 64-token streams {baseline:.2f} s alone (slowest of 3), "
              f"{max(loaded):.2f} s at most with the slow sockets open (6 streams, 3 at a time); "
              f"{full} bytes unread on the stalled socket")
        assert max(loaded) < max(10 * baseline, baseline + 15), (baseline, loaded)
    finally:
        stop.set()
        reader.join(5)
        t0 = time.monotonic()
        stalled.close()
        trickle.close()
    assert check_baseline(server.url, settle_s=10) == []
    print(f"slow sockets closed: back to baseline after {time.monotonic() - t0:.2f} s")
