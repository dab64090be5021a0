"""What a PD role needs from its scheduler (RoleHost) and its counters (factory.py picks the role).

The scheduler calls these hooks: `on_request` (a request with a bootstrap room arrives; True: the
role owns it from now on), `on_reject` (a request refused before it ran: the peer is told),
`on_finish` (True: the role keeps the request's KV slots for now),
`poll` (each loop iteration: apply what the link thread finished), `info` (the ready
handshake) and `stats` (the counters and in-flight gauge for /server_info and metrics).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from moeserve.core import Req
from moeserve.ipc.messages import Bootstrap


class RoleHost(Protocol):
    """The scheduler as a role sees it (scheduler/pd.py implements it)."""

    def kv_buffers(self) -> list[torch.Tensor]: ...

    def room_left(self, num_tokens: int) -> bool: ...

    def alloc_kv(self, num_tokens: int) -> tuple[int, list[int]] | None: ...

    def free_kv(self, row: int, slots: list[int]) -> None: ...

    def release(self, req: Req) -> None: ...

    def step_done(self, req: Req) -> Callable[[], tuple[list[int], bytes] | None]: ...

    def activate(self, req: Req, row: int, slots: list[int], first_token: int,
                 first_logprob: float | None, first_top: list[tuple[int, float]] | None,
                 draft: tuple[list[int], bytes] | None = None) -> None: ...

    def fail(self, req: Req, error: str) -> None: ...


@dataclass
class TransferCounters:
    """Cumulative per rank; /metrics turns them into counters (server/metrics.py)."""

    transfers: int = 0
    bytes: int = 0
    failures: int = 0
    seconds: float = 0.0  # summed transfer latency (prefill: the write; decode: ask → KV in)

    def ok(self, nbytes: int, seconds: float) -> None:
        self.transfers += 1
        self.bytes += nbytes
        self.seconds += seconds

    def as_dict(self, role: str) -> dict[str, Any]:
        return {"role": role, "transfers": self.transfers, "bytes": self.bytes,
                "failures": self.failures, "seconds": self.seconds}


def wants_pd(req: Req, bootstrap: Bootstrap | None) -> bool:
    """Requests go through PD when the router gave them a room and they generate at all."""
    return bootstrap is not None and req.sampling.max_new_tokens > 0
