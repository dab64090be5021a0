"""Gated activations over a fused [.., 2 * I] gate/up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2I] laid out as [gate | up] → silu(gate) * up: [..., I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
