"""When a step runs as two overlapped micro-batches, and how such a step is run.

Every rank votes in the per-step DP sync (dp_attention/sync.py); the step splits when some rank
wants it and none vetoes, so all ranks agree. A rank below `tbo.min_tokens`, with one token or
with none (IDLE) still splits when the step does: its micro-batches may be empty, and an empty
micro-batch joins every collective like an IDLE batch (a rank must never skip one).

CUDA graphs: a decode step that replays a captured graph runs unsplit (graphs are captured
without TBO; the runner tries the graph first, and that choice is the same on every rank).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from moeserve.core import ForwardMode
from moeserve.tbo.operations import ForwardState, Timeline, run_interleaved
from moeserve.tbo.split import split_batch

if TYPE_CHECKING:
    from moeserve.config import TBOConfig
    from moeserve.forward_batch import ForwardBatch

logger = logging.getLogger(__name__)

NO_VOTE = 0  # TBO off here, or too few tokens: this rank follows the others
WANT = 1  # enough tokens: split if nobody vetoes
VETO = 2  # this rank's batch cannot be split (e.g. speculative verification)
SPLITTABLE = (ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.MIXED, ForwardMode.IDLE)


def tbo_active(cfg: TBOConfig, is_moe: bool, ep_size: int) -> bool:
    """TBO applies: enabled, a MoE model and expert parallelism (else a no-op, logged once)."""
    if not cfg.enabled:
        return False
    if not is_moe or ep_size == 1:
        why = "a dense model" if not is_moe else "ep_size=1 (no dispatch to overlap)"
        logger.info("tbo.enabled=true is a no-op: %s", why)
        return False
    return True


def vote(cfg: TBOConfig, active: bool, mode: ForwardMode | None, num_tokens: int) -> int:
    """This rank's vote for the step (same config on every rank)."""
    if not active or mode is None:
        return NO_VOTE
    if mode not in SPLITTABLE:
        return VETO
    return WANT if num_tokens >= cfg.min_tokens else NO_VOTE


def decide(votes: list[int]) -> bool:
    """The step splits: some rank wants it and no rank vetoes."""
    return WANT in votes and VETO not in votes


def forward_two_batches(model, fb: ForwardBatch, timeline: Timeline | None = None
                        ) -> torch.Tensor:
    """The decoder stack (`model.operations()`) over fb as two interleaved micro-batches; →
    final hidden states [T, H] in fb's token order, as the plain forward returns them."""
    a, b = split_batch(fb)
    for part in (a, b):
        part.attn_backend.init_forward_metadata(part)
    sa, sb = ForwardState(a, a.positions, name="a"), ForwardState(b, b.positions, name="b")
    run_interleaved(model.operations(), sa, sb, timeline)
    if timeline is not None:
        timeline.end_step()
    return torch.cat([sa.hidden, sb.hidden])
