"""`allgather` backend: every rank sees every token, runs its local experts, then reduce-scatter.

The path for systems without a usable all-to-all. Ranks hold different token counts, and all_gather
needs equal sizes (gloo cannot gather uneven tensors at all), so the counts come from the step's DP
sync (`tokens_per_rank`) or are all-gathered first (one host sync), and every rank pads to the
largest count T_max; padding rows carry ids -1 and weights 0, so experts give 0 for them.
Communication volume is ep × T_max × H each way regardless of routing.

Start/wait: dispatch_start (after the counts) launches the hidden/ids/weights
all_gathers with async_op=True; dispatch_wait waits. combine_start launches the reduce-scatter
(NCCL; gloo: all_reduce + slice, see comm.reduce_scatter_start); combine_wait waits and drops the
padding. When every rank has 0 tokens, all ranks know it from the counts and skip the data
collectives together.

Overlapped (TBO micro-batches, CUDA): padding, collectives and the receive side run from the side
stream; the compute stream joins at *_wait (ep/streams.py). With the counts from the DP sync
nothing here syncs the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moeserve.ep.comm import Pending, all_gather_counts, all_gather_flat, reduce_scatter_start
from moeserve.ep.dispatcher import (
    STANDARD,
    CombineHandle,
    Dispatcher,
    DispatchHandle,
    DispatchOutput,
)


@dataclass
class _GatherHandle(DispatchHandle):
    max_tokens: int = 0  # T_max over ranks: every rank's block in the gathered tensors
    pending: Pending | None = None


@dataclass
class _GatherCombine(CombineHandle):
    pending: Pending | None = None


def _pad_rows(t: torch.Tensor, rows: int, value: float) -> torch.Tensor:
    """[n, ...] → [rows, ...] padded with `value`."""
    pad = rows - t.shape[0]
    return F.pad(t, (0, 0) * (t.dim() - 1) + (0, pad), value=value) if pad else t.contiguous()


class AllGatherDispatcher(Dispatcher):
    """All-gather dispatch, reduce-scatter combine; see the module docstring."""

    def dispatch_start(self, x, topk_ids, topk_weights, forward_mode=None,
                       tokens_per_rank=None, overlapped=False) -> DispatchHandle:
        on = self.comm.use(overlapped)
        with self.comm.launch(on):
            h = self._dispatch_launch(x, topk_ids, topk_weights, tokens_per_rank)
        h.on_side = on
        return h

    def _dispatch_launch(self, x, topk_ids, topk_weights, tokens_per_rank) -> _GatherHandle:
        counts = tokens_per_rank or all_gather_counts(x.shape[0], x.device, self.group)
        t_max, ep = max(counts), self.mesh.ep_size
        h = _GatherHandle(x.shape[0], x.dtype, t_max)
        srcs = (_pad_rows(x, t_max, 0.0), _pad_rows(topk_ids.long(), t_max, -1),
                _pad_rows(topk_weights.float(), t_max, 0.0))  # [T_max, H], [T_max, K], [T_max, K]
        outs = [s.new_empty((ep * t_max, *s.shape[1:])) for s in srcs]
        works = [] if t_max == 0 else [all_gather_flat(o, s, self.group, async_op=True)
                                       for o, s in zip(outs, srcs)]
        h.pending = Pending(works, lambda: outs, keep=(*srcs, x, topk_ids, topk_weights))
        return h

    def dispatch_wait(self, handle: DispatchHandle) -> DispatchOutput:
        assert isinstance(handle, _GatherHandle) and handle.pending is not None
        with self.comm.finish(handle.on_side):
            hidden, ids, weights = handle.pending.wait()  # [ep*T_max, H], [ep*T_max, K] x2
            ids, weights, counts = self.local_view(ids, weights)
        self.comm.join(self.comm.done(handle.on_side), (hidden, ids, weights, counts))
        return DispatchOutput(STANDARD, hidden, counts, handle, ids, weights)

    def _combine_start(self, expert_out, handle) -> CombineHandle:
        assert isinstance(handle, _GatherHandle)
        with self.comm.launch(handle.on_side):
            ch = self._combine_launch(expert_out, handle)
        ch.on_side = handle.on_side
        return ch

    def _combine_launch(self, expert_out, handle: _GatherHandle) -> _GatherCombine:
        t = handle.num_tokens
        if handle.max_tokens == 0:
            empty = expert_out.new_zeros((0, expert_out.shape[1]))
            return _GatherCombine(t, handle.dtype, Pending([], lambda: empty))
        inner = reduce_scatter_start(expert_out, self.group)  # [ep*T_max, H] → [T_max, H]

        def finish() -> torch.Tensor:
            return inner.finish()[:t].to(handle.dtype)  # drop the padding rows: [T, H]

        return _GatherCombine(t, handle.dtype, Pending(inner.works, finish,
                                                       keep=(*inner.keep, expert_out)))

    def combine_wait(self, handle: CombineHandle) -> torch.Tensor:
        assert isinstance(handle, _GatherCombine) and handle.pending is not None
        with self.comm.finish(handle.on_side):
            out = handle.pending.wait()  # [T, H]
        self.comm.join(self.comm.done(handle.on_side), (out,))
        return out
