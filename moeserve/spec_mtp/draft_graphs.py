"""CUDA graphs for the draft's decode-shaped passes (the chain steps and the draft extend after a
verify), per batch bucket, beside the target's decode graphs.

The one-layer draft is as host-bound as a whole model when launched from Python: on one H200 its
eager pass cost about as much as a replayed decode step of the target (DeepSeek-V3 shape). The
captured forward reads one more static input than the target's, the hidden state it continues
from, and returns the draft's hidden states and logits.
"""

from __future__ import annotations

from typing import Protocol

import torch

from moeserve.forward_batch import ForwardBatch
from moeserve.runtime.cuda_graph import CudaGraphRunner, GraphHost


class DraftPasses(Protocol):
    """The two passes of a draft (spec_mtp/draft.py's Draft) that the graphs capture."""

    def forward(self, fb: ForwardBatch, input_ids: torch.Tensor,
                hidden: torch.Tensor) -> torch.Tensor: ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


class DraftGraphRunner(CudaGraphRunner):
    label = "draft"

    def __init__(self, runner: GraphHost, draft: DraftPasses, max_bs: int):
        super().__init__(runner, max_bs)
        self.draft = draft
        self.static_hidden = torch.zeros(max_bs, runner.hf_config.hidden_size,
                                         dtype=runner.dtype, device=runner.device)

    def _forward(self, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        self.runner.attn_backend.init_forward_metadata(fb)
        hidden = self.draft.forward(fb, fb.input_ids, self.static_hidden[: fb.batch_size])
        return hidden, self.draft.logits(hidden)

    def replay_draft(self, fb: ForwardBatch, hidden: torch.Tensor, bs: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """→ (logits [n, V], draft hidden [n, H]) for fb's n rows continuing from `hidden`
        (views of the graph's buffers, valid until the next replay)."""
        self.static_hidden[: fb.batch_size].copy_(hidden)
        return self.replay(fb, bs, with_hidden=True)
