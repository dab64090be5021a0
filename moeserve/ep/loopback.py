"""`LoopbackDispatcher`: ep_size 1, every expert local, yet dispatch and combine copy their tensors
as a transfer would: on the side stream when overlapped (ep/streams.py). A measurement and test
tool, not a serving backend: on one GPU it runs the whole two-batch-overlap stream/event path
(side stream, events, joins, record_stream) and shows in a profiler trace one micro-batch's
copies beside the other's kernels. Results equal LocalDispatcher's exactly (copies are exact).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from moeserve.ep.dispatcher import (
    STANDARD,
    CombineHandle,
    DispatchHandle,
    DispatchOutput,
    LocalDispatcher,
)


@dataclass
class _LoopHandle(DispatchHandle):
    copies: tuple = ()  # (x, topk_ids, topk_weights) as "received"
    keep: tuple = ()  # the inputs, read on the side stream: referenced until the join
    done: Any = None


@dataclass
class _LoopCombine(CombineHandle):
    y: torch.Tensor | None = None
    keep: tuple = ()
    done: Any = None


class LoopbackDispatcher(LocalDispatcher):
    """Copies instead of transfers; see the module docstring."""

    def dispatch_start(self, x, topk_ids, topk_weights, forward_mode=None,
                       tokens_per_rank=None, overlapped=False) -> DispatchHandle:
        on = self.comm.use(overlapped)
        with self.comm.launch(on):
            copies = (x.clone(), topk_ids.clone(), topk_weights.clone())
        return _LoopHandle(x.shape[0], x.dtype, on_side=on, copies=copies,
                           keep=(x, topk_ids, topk_weights), done=self.comm.done(on))

    def dispatch_wait(self, handle: DispatchHandle) -> DispatchOutput:
        assert isinstance(handle, _LoopHandle)
        self.comm.join(handle.done, handle.copies)
        handle.keep, handle.done = (), None
        x, ids, weights = handle.copies
        ids, weights, counts = self.local_view(ids, weights)
        return DispatchOutput(STANDARD, x, counts, handle, ids, weights)

    def _combine_start(self, expert_out, handle) -> CombineHandle:
        with self.comm.launch(handle.on_side):
            y = expert_out.clone()
        return _LoopCombine(handle.num_tokens, handle.dtype, on_side=handle.on_side, y=y,
                            keep=(expert_out,), done=self.comm.done(handle.on_side))

    def combine_wait(self, handle: CombineHandle) -> torch.Tensor:
        assert isinstance(handle, _LoopCombine) and handle.y is not None
        self.comm.join(handle.done, (handle.y,))
        return handle.y.to(handle.dtype)
