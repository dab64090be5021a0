"""`a2a` backend: torch.distributed all_to_all_single with uneven splits (NCCL and gloo).

Dispatch follows DeepEP normal-mode semantics: each token goes ONCE to each rank that owns at least
one of its top-k experts (not once per expert), with all K ids and weights; the receiver masks the
ids it does not own. Combine sends each received token's partial output back and sums the copies
per source token in float32.

Start/wait: dispatch_start exchanges the per-rank row counts synchronously (the split sizes must be
host ints: one small all_to_all plus a host sync), then launches the hidden/ids/weights all_to_alls
with async_op=True; dispatch_wait waits on them. combine_start launches the reverse all_to_all
async; combine_wait waits and does the index_add. Async works on gloo too (its worker threads run
the collectives), so two dispatches can be in flight on both backends.

Overlapped (TBO micro-batches, CUDA): the packing gathers, the count exchange and the collectives
are issued from the side stream, and the receive side (masking, the combine's index_add) runs
there too; the compute stream joins at *_wait (ep/streams.py). NOTE: the count exchange still
syncs the host with the side stream, which first waits for the compute queued before this
dispatch: with a2a the host stalls once per dispatch; p2p, allgather and DeepEP do not.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from moeserve.ep.comm import Pending, exchange_counts
from moeserve.ep.dispatcher import CollectiveDispatcher, PendingCombine, PendingDispatch
from moeserve.kernels.triton.peer_copy import owner_mask


@dataclass
class _A2AHandle(PendingDispatch):
    send_token: torch.Tensor | None = None  # [S] source token of each sent row, by dest rank
    send_counts: list[int] | None = None  # [ep] rows sent to each rank
    recv_counts: list[int] | None = None  # [ep] rows received from each rank


class A2ADispatcher(CollectiveDispatcher):
    """Uneven all_to_all_single dispatch/combine; see the module docstring."""

    def _dispatch_launch(self, x, topk_ids, topk_weights, tokens_per_rank) -> _A2AHandle:
        in_rank = owner_mask(topk_ids, self.num_local, self.mesh.ep_size)  # [T, ep]
        pairs = in_rank.t().nonzero()  # [S, 2] (dest rank, token), rank-major, tokens in order
        send_token = pairs[:, 1]
        send_counts = in_rank.sum(0)  # [ep]
        recv_counts = exchange_counts(send_counts, self.group)
        h = _A2AHandle(x.shape[0], x.dtype, send_token, send_counts.tolist(), recv_counts)
        n_recv = sum(recv_counts)
        srcs = (x, topk_ids.long(), topk_weights.float())
        outs = [s.new_empty((n_recv, *s.shape[1:])) for s in srcs]  # hidden, ids, weights
        sends = [s[send_token].contiguous() for s in srcs]
        works = [dist.all_to_all_single(o, s, recv_counts, h.send_counts, group=self.group,
                                        async_op=True) for o, s in zip(outs, sends)]
        h.pending = Pending(works, lambda: outs, keep=(*sends, *srcs))
        return h

    def _combine_launch(self, expert_out, handle: _A2AHandle) -> PendingCombine:
        y = expert_out.contiguous()  # [R, H]
        back = y.new_empty((handle.send_token.numel(), y.shape[1]))  # [S, H]
        work = dist.all_to_all_single(back, y, handle.send_counts, handle.recv_counts,
                                      group=self.group, async_op=True)

        def finish() -> torch.Tensor:
            out = torch.zeros(handle.num_tokens, y.shape[1], dtype=torch.float32, device=y.device)
            out.index_add_(0, handle.send_token, back.float())  # sum the copies per source token
            return out.to(handle.dtype)  # [T, H]

        keep = (y, expert_out, handle.send_token)
        return PendingCombine(handle.num_tokens, handle.dtype,
                              pending=Pending([work], finish, keep=keep))
