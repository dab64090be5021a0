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
from moeserve.ep.dispatcher import CollectiveDispatcher, PendingCombine, PendingDispatch


@dataclass
class _GatherHandle(PendingDispatch):
    max_tokens: int = 0  # T_max over ranks: every rank's block in the gathered tensors


def _pad_rows(t: torch.Tensor, rows: int, value: float) -> torch.Tensor:
    """[n, ...] → [rows, ...] padded with `value`."""
    pad = rows - t.shape[0]
    return F.pad(t, (0, 0) * (t.dim() - 1) + (0, pad), value=value) if pad else t.contiguous()


class AllGatherDispatcher(CollectiveDispatcher):
    """All-gather dispatch, reduce-scatter combine; see the module docstring."""

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

    def _combine_launch(self, expert_out, handle: _GatherHandle) -> PendingCombine:
        t = handle.num_tokens
        if handle.max_tokens == 0:
            empty = expert_out.new_zeros((0, expert_out.shape[1]))
            return PendingCombine(t, handle.dtype, pending=Pending([], lambda: empty))
        inner = reduce_scatter_start(expert_out, self.group)  # [ep*T_max, H] → [T_max, H]

        def finish() -> torch.Tensor:
            return inner.finish()[:t].to(handle.dtype)  # drop the padding rows: [T, H]

        return PendingCombine(t, handle.dtype, pending=Pending(inner.works, finish,
                                                               keep=(*inner.keep, expert_out)))
