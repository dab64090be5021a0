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

    scheduler_in: str  # tokenizer manager → scheduler (rank 0 of a DP group / controller)
    detokenizer_in: str  # schedulers → detokenizer
    manager_in: str  # detokenizer + schedulers → tokenizer manager

    @classmethod
    def fresh(cls) -> Endpoints:
        return cls(*(new_ipc_address(t) for t in ("sched", "detok", "mgr")))

_ENCODER = msgspec.msgpack.Encoder()


def new_ipc_address(tag: str) -> str:
    """A fresh ipc:// endpoint in the temp dir (unique per call)."""
    return f"ipc://{os.path.join(tempfile.gettempdir(), f'moeserve-{tag}-{uuid.uuid4().hex[:12]}')}"


class PushQueue:
    def __init__(self, ctx: zmq.Context, address: str, bind: bool = False):
        self.socket = ctx.socket(zmq.PUSH)
        self.socket.setsockopt(zmq.LINGER, 0)
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
        (self.socket.bind if bind else self.socket.connect)(address)
        self.decoder = msgspec.msgpack.Decoder(msg_type)

    async def get(self) -> T:
        frame = await self.socket.recv(copy=False)
        return self.decoder.decode(frame.buffer)

    def close(self) -> None:
        self.socket.close()
