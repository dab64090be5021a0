"""RMSNorm, optionally fused with the residual add."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from moeserve.kernels.cpu.ops import CpuKernels

if TYPE_CHECKING:  # importing it imports Triton
    from moeserve.kernels.triton.ops import TritonOps


class RMSNorm(nn.Module):
    cpu_kernels: CpuKernels | None = None  # set on CPU models (kernels/cpu/ops.py)
    gpu_ops: TritonOps | None = None  # set on CUDA models (kernels.triton.ops)

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without residual: norm(x). With residual: (norm(x + residual), x + residual)."""
        kernels = self.cpu_kernels
        if kernels is None and self.gpu_ops is not None and self.gpu_ops.usable(x):
            kernels = self.gpu_ops
        if (kernels is not None and x.dim() == 2 and x.stride(1) == 1
                and x.dtype == self.weight.dtype
                and (residual is None or (residual.is_contiguous() and residual.dtype == x.dtype))):
            return kernels.rms_norm(x, self.weight, self.eps, residual)  # the same values
        if residual is not None:
            x = x + residual
            residual = x
        # float32 x * rsqrt(mean(x^2) + eps) as one op (bit-identical to the five-op form)
        h = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        out = self.weight * h.to(x.dtype)
        return out if residual is None else (out, residual)


def rms_norm_heads(x: torch.Tensor, groups: list[tuple[int, RMSNorm]]) -> torch.Tensor:
    """x: [T, N, D], its heads in consecutive groups, each (count, RMSNorm over D) → each head
    normalised by its group's norm, all in one pass: exactly RMSNorm per group (Qwen3's q and k
    norms)."""
    eps = groups[0][1].eps
    if any(norm.eps != eps for _, norm in groups):
        raise ValueError("rms_norm_heads: the groups' eps differ")
    d = x.shape[-1]
    weight = torch.cat([norm.weight.expand(count, d) for count, norm in groups])  # [N, D]
    # weight * h, rounded as RMSNorm does (an in-place multiply of strided slices was 4x slower)
    return weight * F.rms_norm(x.float(), (d,), eps=eps).to(x.dtype)
