"""Heartbeats of a decode server's prefill peers, on their own thread.

A probe is an HTTP GET of a peer's bootstrap `/health`. It runs apart from the control link so a
slow answer never holds up KV-done messages, and its timeout can be generous: a starved but live
prefill (a loaded host) must not be declared dead, while a dead one refuses the connection at once
and is caught within `max_failures` intervals. A prefill that hangs without dying is caught by
`waiting_timeout_s` as well.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

Peer = tuple[str, int]

PROBE_TIMEOUT_S = 5.0


class Heartbeats:
    def __init__(self, probe: Callable[[str, int, float], bool], interval_s: float,
                 max_failures: int, timeout_s: float = PROBE_TIMEOUT_S):
        self._probe, self._interval, self._max = probe, interval_s, max_failures
        self._timeout = timeout_s
        self._peers: frozenset[Peer] = frozenset()
        self._dead: queue.SimpleQueue[Peer] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pd-heartbeat", daemon=True)
        self._thread.start()

    def watch(self, peers: frozenset[Peer]) -> None:
        """The peers that owe KV now (any thread; replaces the last set)."""
        self._peers = peers

    def dead(self) -> list[Peer]:
        """Peers declared dead since the last call; each is reported once per declaration."""
        out = []
        while True:
            try:
                out.append(self._dead.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        """Does not wait out a probe in flight (up to the probe timeout): the thread is a daemon
        and reports to nobody once closed."""
        self._stop.set()

    def _run(self) -> None:
        misses: dict[Peer, int] = {}
        while not self._stop.wait(self._interval):
            peers = self._peers
            for peer in list(misses):
                if peer not in peers:
                    del misses[peer]
            for peer in peers:
                if self._probe(*peer, self._timeout):
                    misses.pop(peer, None)
                    continue
                misses[peer] = misses.get(peer, 0) + 1
                if misses[peer] >= self._max:
                    del misses[peer]
                    self._dead.put(peer)
