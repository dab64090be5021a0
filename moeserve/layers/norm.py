"""RMSNorm, optionally fused with the residual add."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without residual: norm(x). With residual: (norm(x + residual), x + residual)."""
        if residual is not None:
            x = x + residual
            residual = x
        # float32 x * rsqrt(mean(x^2) + eps) as one op (bit-identical to the five-op form)
        h = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        out = self.weight * h.to(x.dtype)
        return out if residual is None else (out, residual)
