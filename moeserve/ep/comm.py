"""Collective helpers that behave the same on NCCL (GPUs) and gloo (CPU tests).

`Pending` bundles async `Work`s with the host-side step that finishes the result, so that *_start
can return at once and *_wait does the rest. On NCCL, `Work.wait()` only makes the current CUDA
stream wait (the host does not block); on gloo it blocks the host until the worker thread is done.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


def is_nccl(group: Any) -> bool:
    return dist.get_backend(group) == "nccl"


@dataclass
class Pending:
    """Async collectives plus `finish`, run once after they complete; `keep` pins their buffers."""

    works: list[Any] = field(default_factory=list)
    finish: Callable[[], Any] | None = None
    keep: tuple = ()

    def wait(self) -> Any:
        for w in self.works:
            w.wait()
        self.works = []
        return self.finish() if self.finish is not None else None


def exchange_counts(send_counts: torch.Tensor, group: Any) -> list[int]:
    """send_counts [ep] (rows to each rank) → rows from each rank, as Python ints.

    NOTE: a host sync; uneven all_to_all_single needs its split sizes on the host.
    """
    recv = torch.empty_like(send_counts)
    dist.all_to_all_single(recv, send_counts, group=group)
    return recv.tolist()


def all_gather_counts(n: int, device: torch.device, group: Any) -> list[int]:
    """Each rank's n (e.g. its token count) → list over ranks (host sync)."""
    mine = torch.tensor([n], dtype=torch.int64, device=device)
    out = torch.empty(dist.get_world_size(group), dtype=torch.int64, device=device)
    all_gather_flat(out, mine, group)
    return out.tolist()


def all_gather_flat(out: torch.Tensor, inp: torch.Tensor, group: Any, async_op: bool = False):
    """out [ep * n, ...] ← every rank's inp [n, ...] in rank order (equal n on every rank)."""
    # torch ≥ 2.13 renamed all_gather_into_tensor (the old name warns)
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=group, async_op=async_op)


def reduce_scatter_start(inp: torch.Tensor, group: Any) -> Pending:
    """inp [ep * n, ...] summed over ranks; this rank keeps block [rank*n, (rank+1)*n).

    NCCL: reduce_scatter (each rank receives only its block). gloo: reduce-scatter is missing in
    older torch releases (the project supports torch ≥ 2.6), so all_reduce the whole buffer and
    slice; this moves ep× more bytes, acceptable for the CPU test path only.
    """
    ep, rank = dist.get_world_size(group), dist.get_rank(group)
    n = inp.shape[0] // ep
    if is_nccl(group):
        out = inp.new_empty((n, *inp.shape[1:]))
        fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        work = fn(out, inp.contiguous(), group=group, async_op=True)
        return Pending([work], lambda: out, keep=(inp,))
    buf = inp.clone()
    work = dist.all_reduce(buf, group=group, async_op=True)
    return Pending([work], lambda: buf[rank * n : (rank + 1) * n])
