"""Typed ZMQ PUSH/PULL endpoints: encode on send, decode into the channel's union on receive.

A frame that does not decode as the channel's type (a stray local process writing to the socket,
say) is dropped with a log line, never unpickled and never raised into the process loop; ipc://
socket files are made private to the user (0600) when bound.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
import uuid
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import msgspec
import zmq
import zmq.asyncio

T = TypeVar("T")


@dataclass(frozen=True)
class Endpoints:
    """The PULL addresses of each role (each role binds its own, everyone else connects)."""

    scheduler_in: str  # tokenizer manager → scheduler (dp_size 1) or DP controller
    detokenizer_in: str  # schedulers → detokenizer
    manager_in: str  # detokenizer + schedulers → tokenizer manager
    rank_in: tuple[str, ...] = ()  # dp_size > 1: DP controller → each rank's scheduler
    controller_in: str | None = None  # dp_size > 1: ranks' load reports → DP controller

    @classmethod
    def fresh(cls, dp_size: int = 1) -> Endpoints:
        base = [new_ipc_address(t) for t in ("sched", "detok", "mgr")]
        if dp_size == 1:
            return cls(*base)
        ranks = tuple(new_ipc_address(f"rank{r}") for r in range(dp_size))
        return cls(*base, rank_in=ranks, controller_in=new_ipc_address("ctrl"))

    @classmethod
    def tcp(cls, host: str, base_port: int, dp_size: int,
            rank_hosts: tuple[str, ...] | None = None) -> Endpoints:
        """tcp:// addresses for ranks on several nodes (every process derives the same ones):
        scheduler_in, detokenizer_in, manager_in, controller_in on `host` (node 0) at base_port
        .. base_port+3, rank r's inbox on rank_hosts[r] (default `host`) at base_port+4+r.
        dp_size must be > 1: a multi-node deployment has one DP rank per scheduler rank."""
        if dp_size < 2:
            raise ValueError(f"Endpoints.tcp needs dp_size > 1, got {dp_size}")
        hosts = rank_hosts or (host,) * dp_size
        if len(hosts) != dp_size:
            raise ValueError(f"{len(hosts)} rank hosts for dp_size {dp_size}")
        at = [f"tcp://{host}:{base_port + i}" for i in range(4)]
        ranks = tuple(f"tcp://{h}:{base_port + 4 + r}" for r, h in enumerate(hosts))
        return cls(at[0], at[1], at[2], rank_in=ranks, controller_in=at[3])

    @staticmethod
    def tcp_port_count(dp_size: int) -> int:
        """How many consecutive ports `tcp(...)` uses from base_port."""
        return 4 + dp_size

    def scheduler_address(self, dp_rank: int) -> str:
        """Where the scheduler of `dp_rank` receives requests."""
        return self.rank_in[dp_rank] if self.rank_in else self.scheduler_in

_ENCODER = msgspec.msgpack.Encoder()
logger = logging.getLogger(__name__)
_BAD_LOG_INTERVAL_S = 5.0


class _Decoder:
    """The channel's msgpack decoder; garbage → None plus a log line (at most one per
    _BAD_LOG_INTERVAL_S per socket, with the count dropped since the last one)."""

    def __init__(self, msg_type: Any, address: str):
        self._decoder = msgspec.msgpack.Decoder(msg_type)
        self._address = address
        self.dropped = 0
        self._unlogged = 0
        self._next_log = 0.0

    def __call__(self, buf: Any) -> Any:
        try:
            return self._decoder.decode(buf)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            self.dropped += 1
            self._unlogged += 1
            now = time.monotonic()
            if now >= self._next_log:
                logger.warning("dropped %d undecodable message(s) on %s (last: %d bytes: %s)",
                               self._unlogged, self._address, len(buf), e)
                self._unlogged, self._next_log = 0, now + _BAD_LOG_INTERVAL_S
            return None


def _bind_or_connect(socket: zmq.Socket, address: str, bind: bool) -> None:
    if not bind:
        socket.connect(address)
        return
    socket.bind(address)
    if address.startswith("ipc://"):
        try:
            os.chmod(address[len("ipc://"):], 0o600)  # other users cannot connect
        except OSError:
            pass


def new_ipc_address(tag: str) -> str:
    """A fresh ipc:// endpoint in the temp dir (unique per call)."""
    return f"ipc://{os.path.join(tempfile.gettempdir(), f'moeserve-{tag}-{uuid.uuid4().hex[:12]}')}"


class PushQueue:
    def __init__(self, ctx: zmq.Context, address: str, bind: bool = False):
        self.socket = ctx.socket(zmq.PUSH)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SNDHWM, 0)  # never block a sender (the asyncio loop)
        _bind_or_connect(self.socket, address, bind)

    def put(self, msg: Any) -> None:
        self.socket.send(_ENCODER.encode(msg), copy=False)

    def close(self) -> None:
        self.socket.close()


class PullQueue(Generic[T]):
    """Receives messages of the union type `T`; never unpickles; drops garbage (see _Decoder)."""

    def __init__(self, ctx: zmq.Context, address: str, msg_type: Any, bind: bool = True):
        self.socket = ctx.socket(zmq.PULL)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.RCVHWM, 0)
        _bind_or_connect(self.socket, address, bind)
        self.decode = _Decoder(msg_type, address)

    def get(self, timeout_ms: int | None = None) -> T | None:
        """Block up to timeout_ms (None = forever) for a valid message; None on timeout."""
        deadline = None if timeout_ms is None else time.monotonic() + timeout_ms / 1000
        while True:
            left = None if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))
            if left is not None and not self.socket.poll(left):
                return None
            msg = self.decode(self.socket.recv(copy=False).buffer)
            if msg is not None:
                return msg

    def get_nowait_all(self) -> list[T]:
        out = []
        while self.socket.poll(0):
            msg = self.decode(self.socket.recv(copy=False).buffer)
            if msg is not None:
                out.append(msg)
        return out

    def close(self) -> None:
        self.socket.close()


class AsyncPullQueue(Generic[T]):
    def __init__(self, ctx: zmq.asyncio.Context, address: str, msg_type: Any, bind: bool = True):
        self.socket = ctx.socket(zmq.PULL)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.RCVHWM, 0)
        _bind_or_connect(self.socket, address, bind)
        self.decode = _Decoder(msg_type, address)

    async def get(self) -> T:
        while True:
            frame = await self.socket.recv(copy=False)
            msg = self.decode(frame.buffer)
            if msg is not None:
                return msg

    def close(self) -> None:
        self.socket.close()
