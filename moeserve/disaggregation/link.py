"""ControlLink: one daemon thread per PD rank that owns its ZMQ sockets and runs its transfers, so
the scheduler's loop never blocks on a peer. The loop hands it work with `call`; it hands results
back through the role's own queue."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

import zmq

from moeserve.disaggregation.messages import DECODER, ENCODER, ControlMsg

logger = logging.getLogger(__name__)

POLL_MS = 2


class ControlLink:
    def __init__(self, host: str, on_message: Callable[[ControlMsg], None],
                 on_tick: Callable[[float], None], tick_s: float = 0.05):
        self.ctx = zmq.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        port = self.pull.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{host}:{port}"
        self._push: dict[str, zmq.Socket] = {}
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._on_message, self._on_tick, self._tick_s = on_message, on_tick, tick_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pd-link", daemon=True)
        self._thread.start()

    def call(self, fn: Callable, *args) -> None:
        """Run fn(*args) on the link's thread (any thread may call this)."""
        self._calls.put((fn, args))

    def send(self, endpoint: str, msg: ControlMsg) -> None:
        """Link thread only. Never blocks: a peer that is gone loses the message."""
        sock = self._push.get(endpoint)
        if sock is None:
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 10000)
            sock.connect(endpoint)
            self._push[endpoint] = sock
        try:
            sock.send(ENCODER.encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            logger.warning("control message to %s dropped (peer not reading)", endpoint)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for s in [self.pull, *self._push.values()]:
            s.close(0)
        self.ctx.term()

    def _run(self) -> None:
        next_tick = 0.0
        while not self._stop.is_set():
            try:
                if self.pull.poll(POLL_MS):
                    while True:
                        try:
                            raw = self.pull.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._on_message(DECODER.decode(raw))
                while True:
                    try:
                        fn, args = self._calls.get_nowait()
                    except queue.Empty:
                        break
                    fn(*args)
                now = time.monotonic()
                if now >= next_tick:
                    next_tick = now + self._tick_s
                    self._on_tick(now)
            except Exception:  # a bad message or a bug must not kill the link silently
                logger.exception("PD control link error")
