"""Tokens per local expert slot, in torch: the align kernels' torch path and the EP dispatchers'
receive counts use it (no Triton, so CPU-only installs import it)."""

from __future__ import annotations

import torch


def count_per_expert(slot: torch.Tensor, num_experts: int) -> torch.Tensor:
    """slot [N] in [0, num_experts] (num_experts = not local) → int64 [num_experts] counts, with no
    host sync (bincount syncs on CUDA). On CUDA a one-hot sum: scatter_add's atomics pile onto the
    few counters (75 µs for 131k ids on H200)."""
    if slot.is_cuda:
        return (slot[:, None] == torch.arange(num_experts, device=slot.device)).sum(0)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=slot.device)
    return counts.scatter_add_(0, slot, torch.ones_like(slot))[:num_experts]
