"""Top-k expert selection: plain softmax top-k and DeepSeek's grouped top-k.

Returns (topk_weights [T, K] float32, topk_ids [T, K] int64) in logical expert ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from moeserve.kernels.cpu.ops import CpuKernels

if TYPE_CHECKING:  # importing it imports Triton
    from moeserve.kernels.triton.ops import TritonOps


@dataclass(frozen=True)
class RouterConfig:
    top_k: int
    scoring: str = "softmax"  # softmax | sigmoid
    renormalize: bool = True  # divide the chosen weights by their sum
    num_groups: int = 1  # grouped top-k: experts split into groups, only topk_groups kept
    topk_groups: int = 1
    group_score: str = "max"  # max (DeepSeek-V2) | top2_sum (DeepSeek-V3)
    routed_scaling_factor: float = 1.0

    @property
    def is_plain_softmax(self) -> bool:
        """A softmax top-k with nothing else (no groups, no scaling): what one kernel does."""
        return (self.scoring == "softmax" and self.num_groups == 1
                and self.routed_scaling_factor == 1.0)


def select_experts(logits: torch.Tensor, cfg: RouterConfig,
                   correction_bias: torch.Tensor | None = None,
                   kernels: CpuKernels | TritonOps | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [T, E] → (weights, ids). The correction bias (V3) steers choice, not the weights.
    With kernels (CPU or Triton: the caller picks by device), a plain softmax top-k is one
    kernel call."""
    if (kernels is not None and cfg.is_plain_softmax and correction_bias is None
            and logits.is_contiguous()):
        return kernels.topk_softmax(logits, cfg.top_k, cfg.renormalize)
    if kernels is not None and hasattr(kernels, "grouped_topk"):  # Triton: DeepSeek's routers
        chosen = kernels.grouped_topk(logits, cfg, correction_bias)
        if chosen is not None:
            return chosen
    logits = logits.float()
    scores = logits.sigmoid() if cfg.scoring == "sigmoid" else logits.softmax(dim=-1)  # [T, E]
    choice = scores if correction_bias is None else scores + correction_bias.float()[None]
    if cfg.num_groups > 1:
        choice = _mask_groups(choice, cfg)
    ids = torch.topk(choice, cfg.top_k, dim=-1, sorted=True).indices  # [T, K]
    weights = scores.gather(1, ids)
    if cfg.renormalize:
        total = weights.sum(dim=-1, keepdim=True)
        weights = weights / (total + 1e-20 if cfg.scoring == "sigmoid" else total)
    if cfg.routed_scaling_factor != 1.0:  # x * 1.0 is x: skip the op
        weights = weights * cfg.routed_scaling_factor
    return weights, ids


def _mask_groups(choice: torch.Tensor, cfg: RouterConfig) -> torch.Tensor:
    """Keep only the experts of the topk_groups best groups; the rest get -inf."""
    t, e = choice.shape
    grouped = choice.view(t, cfg.num_groups, e // cfg.num_groups)  # [T, G, E/G]
    if cfg.group_score == "top2_sum":
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
    else:
        group_scores = grouped.max(dim=-1).values
    keep = group_scores.topk(cfg.topk_groups, dim=-1, sorted=False).indices  # [T, g]
    group_mask = torch.zeros_like(group_scores).scatter_(1, keep, 1.0).bool()
    expert_mask = group_mask[:, :, None].expand_as(grouped).reshape(t, e)
    return choice.masked_fill(~expert_mask, float("-inf"))
