"""The decode side's heartbeat thread, against real HTTP endpoints through the real probe: a
closed port is declared dead within `max_failures` intervals, a server that answers slowly (but
within the probe timeout) is not, and one that starts answering again is forgiven."""

from __future__ import annotations

import http.server
import socket
import threading
import time

from moeserve.disaggregation.bootstrap import probe
from moeserve.disaggregation.heartbeat import Heartbeats


def _serve(delay: float) -> http.server.ThreadingHTTPServer:
    """A /health that answers 200 after `delay` s, on a free loopback port, served in a thread."""

    class Slow(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            time.sleep(delay)
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Slow)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_dead(hb: Heartbeats, seconds: float) -> list:
    end, out = time.monotonic() + seconds, []
    while time.monotonic() < end and not out:
        out = hb.dead()
        time.sleep(0.02)
    return out


def test_dead_peer_is_declared_and_slow_one_is_not():
    server = _serve(0.4)
    slow, gone = ("127.0.0.1", server.server_address[1]), ("127.0.0.1", _closed_port())
    hb = Heartbeats(probe, interval_s=0.05, max_failures=2, timeout_s=2.0)
    try:
        hb.watch(frozenset({slow, gone}))
        assert _wait_dead(hb, 5.0) == [gone]
        hb.watch(frozenset({slow}))  # the slow one answers every probe (8x the interval)
        time.sleep(1.5)
        assert hb.dead() == []
    finally:
        hb.close()
        server.shutdown()


def test_timeouts_count_as_misses():
    server = _serve(0.5)
    peer = ("127.0.0.1", server.server_address[1])
    hb = Heartbeats(probe, interval_s=0.05, max_failures=2, timeout_s=0.1)
    try:
        hb.watch(frozenset({peer}))
        assert _wait_dead(hb, 5.0) == [peer]
    finally:
        hb.close()
        server.shutdown()
