"""The expert-parallel dispatch/combine interface that every backend implements.

A MoE layer under expert parallelism does, on every rank of the EP group:

    out = d.dispatch(x, topk_ids, topk_weights, mode)  # tokens go to the ranks owning their experts
    y = d.experts_forward(experts, out)                 # local experts, in out.format's layout
    return d.combine(y, out)                            # [T, H]: sum over ALL experts of w * f_e(x)

Each phase is split into *_start (launch the communication) and *_wait (block until the result may
be read) so that two-batch overlap can interleave one micro-batch's communication with another's
compute. `overlapped=True` (the micro-batches of a TBO step) moves a backend's communication onto
its side stream on CUDA (ep/streams.py); plain steps keep everything on the current stream.

Contract (all backends):
- Every call is collective over `mesh.ep_group`: each rank calls dispatch_start/combine_start the
  same number of times, in the same order, with the same `forward_mode`, even with T = 0 tokens (an
  IDLE rank). Skipping a call hangs the other ranks.
- `forward_mode` must be the step's GLOBAL forward mode (equal on all ranks); the deepep backend
  picks its kernels (normal vs low-latency) from it, the others ignore it.
- Handles may be waited in any order after they were started; a DispatchOutput stays valid until
  its combine has been waited.
- Output formats are explicit (`DispatchOutput.format`), so the MoE layer never guesses a layout.

Expert placement lives in `expert_owner` alone (kernels/triton/peer_copy.py, beside the p2p
kernels that mirror it) so that EPLB can swap logical ids for physical ones.
"""

from __future__ import annotations

import abc
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from moeserve.ep.comm import Pending
from moeserve.ep.streams import CommStream
# re-exported: the placement rule
from moeserve.kernels.triton.peer_copy import expert_owner  # noqa: F401
from moeserve.kernels.slot_counts import count_per_expert

if TYPE_CHECKING:
    from moeserve.core import ForwardMode
    from moeserve.distributed import ParallelMesh
    from moeserve.layers.moe import MoEExperts

STANDARD = "standard"
LOW_LATENCY = "low_latency"


@dataclass
class DispatchHandle:
    """One dispatch in flight; once waited it carries what combine needs. Backends subclass it."""

    num_tokens: int  # T on this rank
    dtype: torch.dtype  # of x: combine returns this dtype
    # launched on the side stream (overlapped, on CUDA): the waits join it (ep/streams.py)
    on_side: bool = field(default=False, kw_only=True)


@dataclass
class CombineHandle:
    """One combine in flight. Backends subclass it."""

    num_tokens: int
    dtype: torch.dtype
    on_side: bool = field(default=False, kw_only=True)  # as its dispatch


@dataclass(frozen=True)
class DispatchOutput:
    """What arrived on this rank.

    format == "standard":
        hidden [N_recv, H]          received tokens (each at most once per rank)
        topk_ids [N_recv, K]        global expert ids; ids this rank does not own are -1
        topk_weights [N_recv, K]    float32 (0 where the id is -1)
        tokens_per_expert [E_local] int64, received (token, local expert) pairs per expert
        experts return [N_recv, H]: per received token, the weighted sum over local experts.
    format == "low_latency":
        hidden [E_local, M, H]      M = max_tokens_per_rank * ep_size; row j of expert e is valid
                                    when j < tokens_per_expert[e], the rest is padding (may be
                                    garbage)
        tokens_per_expert [E_local] int
        topk_ids / topk_weights     None (the weights are applied inside combine)
        experts return [E_local, M, H]: the UNweighted expert outputs, same layout.
    """

    format: str
    hidden: torch.Tensor
    tokens_per_expert: torch.Tensor
    handle: DispatchHandle
    topk_ids: torch.Tensor | None = None
    topk_weights: torch.Tensor | None = None


def run_experts_standard(experts: MoEExperts, out: DispatchOutput) -> torch.Tensor:
    """[N_recv, H] → [N_recv, H] weighted over the local experts (MoEExperts masks -1 ids)."""
    if out.hidden.shape[0] == 0:
        return out.hidden.clone()
    return experts(out.hidden, out.topk_ids, out.topk_weights)


def run_experts_low_latency(experts: MoEExperts, out: DispatchOutput) -> torch.Tensor:
    """[E_local, M, H] → [E_local, M, H]: each expert's MLP over its padded rows, no host sync.

    NOTE: padding rows are computed too (DeepGEMM's masked grouped GEMM would skip them); combine
    never reads them.
    """
    x = out.hidden  # [E_local, M, H]
    if experts.num_local != x.shape[0]:
        raise ValueError(f"experts hold {experts.num_local} local experts, "
                         f"dispatch gave {x.shape[0]}")
    return experts.forward_per_expert(x)  # [E_local, M, H]


EXPERT_RUNNERS: dict[str, Callable[[Any, DispatchOutput], torch.Tensor]] = {
    STANDARD: run_experts_standard,
    LOW_LATENCY: run_experts_low_latency,
}


class Dispatcher(abc.ABC):
    """Moves tokens to the ranks owning their experts and the outputs back (see module doc)."""

    def __init__(self, mesh: ParallelMesh, num_experts: int, hidden_size: int,
                 dtype: torch.dtype):
        if num_experts % mesh.ep_size:
            raise ValueError(f"{num_experts} experts do not divide over ep_size {mesh.ep_size}")
        self.mesh = mesh
        self.group = mesh.ep_group
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.num_local = num_experts // mesh.ep_size
        self.first_expert = mesh.ep_rank * self.num_local
        self.comm = CommStream(mesh.device)  # side stream for overlapped calls (CUDA only)

    @abc.abstractmethod
    def dispatch_start(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                       forward_mode: ForwardMode | None = None,
                       tokens_per_rank: list[int] | None = None,
                       overlapped: bool = False) -> DispatchHandle:
        """x [T, H], topk_ids [T, K] global ids, topk_weights [T, K] float32. Collective.

        tokens_per_rank: every EP rank's T this step when the caller knows them (the DP sync
        does), so that backends needing them skip their own count exchange (a host sync).
        overlapped: another micro-batch computes meanwhile (TBO; equal on every rank): on CUDA
        the communication runs on the side stream, and its combine follows it there."""

    @abc.abstractmethod
    def dispatch_wait(self, handle: DispatchHandle) -> DispatchOutput:
        """Blocks (or orders the current stream) until the received tokens may be read."""

    @abc.abstractmethod
    def _combine_start(self, expert_out: torch.Tensor, handle: DispatchHandle) -> CombineHandle:
        ...

    @abc.abstractmethod
    def combine_wait(self, handle: CombineHandle) -> torch.Tensor:
        """→ [T, H] in x's dtype: sum over all experts of w * expert(x) for this rank's tokens."""

    def combine_start(self, expert_out: torch.Tensor,
                      dispatched: DispatchOutput | DispatchHandle) -> CombineHandle:
        """expert_out in the layout of `dispatched.format` (see DispatchOutput). Collective."""
        handle = dispatched.handle if isinstance(dispatched, DispatchOutput) else dispatched
        return self._combine_start(expert_out, handle)

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 forward_mode: ForwardMode | None = None,
                 tokens_per_rank: list[int] | None = None,
                 overlapped: bool = False) -> DispatchOutput:
        return self.dispatch_wait(self.dispatch_start(x, topk_ids, topk_weights, forward_mode,
                                                      tokens_per_rank, overlapped))

    def combine(self, expert_out: torch.Tensor,
                dispatched: DispatchOutput | DispatchHandle) -> torch.Tensor:
        return self.combine_wait(self.combine_start(expert_out, dispatched))

    def experts_forward(self, experts: MoEExperts, out: DispatchOutput) -> torch.Tensor:
        """Run this rank's experts on `out` in its format; feed the result to combine."""
        return EXPERT_RUNNERS[out.format](experts, out)

    def local_view(self, topk_ids: torch.Tensor,
                   topk_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Received global ids [N, K] → (ids with non-local = -1, weights with those = 0,
        tokens_per_expert [E_local])."""
        local = (topk_ids >= self.first_expert) & (topk_ids < self.first_expert + self.num_local)
        ids = torch.where(local, topk_ids, -1)
        weights = torch.where(local, topk_weights, 0.0)
        slot = torch.where(local, topk_ids - self.first_expert, self.num_local).flatten()
        return ids, weights, count_per_expert(slot, self.num_local)


@dataclass
class PendingDispatch(DispatchHandle):
    """A dispatch whose collectives are in flight as a `Pending` yielding (hidden, ids, weights)."""

    pending: Pending | None = field(default=None, kw_only=True)


@dataclass
class PendingCombine(CombineHandle):
    """A combine whose collectives are in flight as a `Pending` yielding [T, H]."""

    pending: Pending | None = field(default=None, kw_only=True)


class CollectiveDispatcher(Dispatcher):
    """A backend whose dispatch and combine are torch.distributed collectives (a2a, allgather).
    It writes `_dispatch_launch` and `_combine_launch`; the start/wait methods here launch them
    on the side stream when overlapped, wait on their Pending, keep the received ids this rank
    owns (`local_view`) and make the compute stream join (ep/streams.py)."""

    @abc.abstractmethod
    def _dispatch_launch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                         tokens_per_rank: list[int] | None) -> PendingDispatch:
        """Launch the dispatch's collectives (on the current stream)."""

    @abc.abstractmethod
    def _combine_launch(self, expert_out: torch.Tensor, handle: PendingDispatch
                        ) -> PendingCombine:
        """Launch the combine's collectives (on the current stream)."""

    def dispatch_start(self, x, topk_ids, topk_weights, forward_mode=None,
                       tokens_per_rank=None, overlapped=False) -> DispatchHandle:
        on = self.comm.use(overlapped)
        with self.comm.launch(on):
            h = self._dispatch_launch(x, topk_ids, topk_weights, tokens_per_rank)
        h.on_side = on
        return h

    def dispatch_wait(self, handle: DispatchHandle) -> DispatchOutput:
        assert isinstance(handle, PendingDispatch) and handle.pending is not None
        with self.comm.finish(handle.on_side):
            hidden, ids, weights = handle.pending.wait()  # [R, H], [R, K], [R, K]
            ids, weights, counts = self.local_view(ids, weights)
        self.comm.join(self.comm.done(handle.on_side), (hidden, ids, weights, counts))
        return DispatchOutput(STANDARD, hidden, counts, handle, ids, weights)

    def _combine_start(self, expert_out, handle) -> CombineHandle:
        assert isinstance(handle, PendingDispatch)
        with self.comm.launch(handle.on_side):
            ch = self._combine_launch(expert_out, handle)
        ch.on_side = handle.on_side
        return ch

    def combine_wait(self, handle: CombineHandle) -> torch.Tensor:
        assert isinstance(handle, PendingCombine) and handle.pending is not None
        with self.comm.finish(handle.on_side):
            out = handle.pending.wait()  # [T, H]
        self.comm.join(self.comm.done(handle.on_side), (out,))
        return out


@dataclass
class _LocalHandle(DispatchHandle):
    out: DispatchOutput | None = None


class LocalDispatcher(Dispatcher):
    """ep_size == 1: every expert is local; dispatch and combine move nothing."""

    def dispatch_start(self, x, topk_ids, topk_weights, forward_mode=None,
                       tokens_per_rank=None, overlapped=False) -> DispatchHandle:
        h = _LocalHandle(x.shape[0], x.dtype)
        ids, w, counts = self.local_view(topk_ids, topk_weights)
        h.out = DispatchOutput(STANDARD, x, counts, h, ids, w)
        return h

    def dispatch_wait(self, handle: DispatchHandle) -> DispatchOutput:
        assert isinstance(handle, _LocalHandle) and handle.out is not None
        return handle.out

    def _combine_start(self, expert_out, handle) -> CombineHandle:
        ch = _LocalCombine(handle.num_tokens, handle.dtype)
        ch.y = expert_out
        return ch

    def combine_wait(self, handle: CombineHandle) -> torch.Tensor:
        assert isinstance(handle, _LocalCombine)
        return handle.y.to(handle.dtype)


@dataclass
class _LocalCombine(CombineHandle):
    y: Any = None


_BACKENDS = {
    "a2a": ("moeserve.ep.a2a", "A2ADispatcher"),
    "allgather": ("moeserve.ep.allgather", "AllGatherDispatcher"),
    "p2p": ("moeserve.ep.p2p", "P2PDispatcher"),
    "deepep": ("moeserve.ep.deepep", "DeepEPDispatcher"),  # imports deep_ep only when built
}


def create_dispatcher(backend: str, mesh: ParallelMesh, num_experts: int, hidden_size: int,
                      dtype: torch.dtype, deepep_mode: str = "auto",
                      max_dispatch_tokens_per_rank: int = 128,
                      deep_ep_module: Any = None,
                      max_tokens_per_rank: int = 2048) -> Dispatcher:
    """Build the `parallel.a2a_backend` dispatcher (lazy import); ep_size 1 needs no communication.

    deepep_mode / max_dispatch_tokens_per_rank / deep_ep_module only concern the deepep backend
    (deep_ep_module injects an emulation for tests; None imports the real `deep_ep`);
    max_tokens_per_rank sizes the p2p backend's buffers (the most tokens one rank forwards).
    """
    if backend not in _BACKENDS:
        raise ValueError(f"parallel.a2a_backend={backend!r}: expected one of {sorted(_BACKENDS)}")
    if mesh.ep_size == 1:
        return LocalDispatcher(mesh, num_experts, hidden_size, dtype)
    module, name = _BACKENDS[backend]
    cls = getattr(importlib.import_module(module), name)
    if backend == "deepep":
        return cls(mesh, num_experts, hidden_size, dtype, mode=deepep_mode,
                   max_dispatch_tokens_per_rank=max_dispatch_tokens_per_rank,
                   deep_ep_module=deep_ep_module)
    if backend == "p2p":
        return cls(mesh, num_experts, hidden_size, dtype, max_tokens_per_rank=max_tokens_per_rank)
    return cls(mesh, num_experts, hidden_size, dtype)
