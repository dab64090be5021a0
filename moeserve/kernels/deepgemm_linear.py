"""DeepGEMM's block-scaled FP8 GEMM for FP8 linears (optional: where `deep_gemm` imports, and
only with `model.fp8_gemm=deep_gemm`).

Why: DeepSeek's own Hopper kernels for exactly its 1x128 activation / 128x128 weight scales,
JIT-compiled per shape. FP8 linears take it at the token counts where the Triton GEMM or
torch._scaled_mm would run (M > FUSED_MAX_M: prefill and large decode batches) when the shape
fits it; decode's small M keeps the W8A16 GEMV and the fused kernel (layers/fp8_linear.py).
Not selected by default: it is not yet measured against those paths here (docs/fp8.md).

DeepGEMM >= 2.0 (`fp8_gemm_nt`) transforms the scale layouts itself; 1.x
(`gemm_fp8_fp8_bf16_nt`) wants the activation scales column-major and TMA-aligned.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from moeserve.kernels.fp8_format import FP8_BLOCK, Block


@functools.cache
def deep_gemm_module() -> ModuleType | None:
    """`deep_gemm`, or None where it does not import (not installed, or built for another CUDA)."""
    try:
        import deep_gemm
    except Exception:  # noqa: BLE001 - a broken extension is "not available", not a crash
        return None
    return deep_gemm if hasattr(deep_gemm, "fp8_gemm_nt") or hasattr(
        deep_gemm, "gemm_fp8_fp8_bf16_nt") else None


def deep_gemm_supports(n: int, k: int, block: Block, dtype: torch.dtype) -> bool:
    """Shapes DeepGEMM takes: 128 x 128 blocks, K a multiple of 128, N of 64, bf16 output."""
    return block == (FP8_BLOCK, FP8_BLOCK) and k % 128 == 0 and n % 64 == 0 \
        and dtype == torch.bfloat16


def deep_gemm_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] bf16 → quant(x) @ (w * w_scale)^T [M, N] bf16, w [N, K] e4m3 (contiguous) with
    w_scale [N / 128, K / 128] float32; the activations quantized per token and 128 channels
    by kernels/triton/fp8.py (the values every other FP8 path uses)."""
    from moeserve.kernels.triton.fp8 import quant_fp8_per_token_group

    dg = deep_gemm_module()
    assert dg is not None, "deep_gemm does not import here"
    x_q, x_s = quant_fp8_per_token_group(x, FP8_BLOCK)
    out = torch.empty((x.shape[0], w.shape[0]), dtype=torch.bfloat16, device=x.device)
    if hasattr(dg, "fp8_gemm_nt"):
        dg.fp8_gemm_nt((x_q, x_s), (w, w_scale), out)
    else:
        dg.gemm_fp8_fp8_bf16_nt((x_q, dg.get_col_major_tma_aligned_tensor(x_s)), (w, w_scale),
                                out)
    return out
