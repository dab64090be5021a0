"""Typed ZMQ PUSH/PULL endpoints: encode on send, decode into the channel's union on receive."""

from __future__ import annotations

import os
import tempfile
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


def new_ipc_address(tag: str) -> str:
    """A fresh ipc:// endpoint in the temp dir (unique per call)."""
    return f"ipc://{os.path.join(tempfile.gettempdir(), f'moeserve-{tag}-{uuid.uuid4().hex[:12]}')}"


class PushQueue:
    def __init__(self, ctx: zmq.Context, address: str, bind: bool = False):
        self.socket = ctx.socket(zmq.PUSH)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SNDHWM, 0)  # never block a sender (the asyncio loop)
        (self.socket.bind if bind else self.socket.connect)(address)

    def put(self, msg: Any) -> None:
        self.socket.send(_ENCODER.encode(msg), copy=False)

    def close(self) -> None:
        self.socket.close()


class PullQueue(Generic[T]):
    """Receives messages of the union type `T`; never unpickles."""

    def __init__(self, ctx: zmq.Context, address: str, msg_type: Any, bind: bool = True):
        self.socket = ctx.socket(zmq.PULL)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.RCVHWM, 0)
        (self.socket.bind if bind else self.socket.connect)(address)
        self.decoder = msgspec.msgpack.Decoder(msg_type)

    def get(self, timeout_ms: int | None = None) -> T | None:
        """Block up to timeout_ms (None = forever); None on timeout."""
        if timeout_ms is not None and not self.socket.poll(timeout_ms):
            return None
        return self.decoder.decode(self.socket.recv(copy=False).buffer)

    def get_nowait_all(self) -> list[T]:
        out = []
        while self.socket.poll(0):
            out.append(self.decoder.decode(self.socket.recv(copy=False).buffer))
        return out

    def close(self) -> None:
        self.socket.close()


class AsyncPullQueue(Generic[T]):
    def __init__(self, ctx: zmq.asyncio.Context, address: str, msg_type: Any, bind: bool = True):
        self.socket = ctx.socket(zmq.PULL)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.RCVHWM, 0)
        (self.socket.bind if bind else self.socket.connect)(address)
        self.decoder = msgspec.msgpack.Decoder(msg_type)

    async def get(self) -> T:
        frame = await self.socket.recv(copy=False)
        return self.decoder.decode(frame.buffer)

    def close(self) -> None:
        self.socket.close()
