"""Which FP8 kernel a linear call takes, by its token count M, activation dtype and weight size.

Shared by `fp8_linear` (which dispatches on it, layers/fp8_linear.py) and the float64 emulation
(which must quantize the activations exactly where the chosen kernel does,
layers/fp8_emulation.py), so that neither imports the other's module for it.
"""

from __future__ import annotations

import torch

W8A16_MAX_M = 1  # M <= this: the W8A16 GEMV (as `Linear` takes the bf16 GEMV: LINEAR_MAX_M)
W8A16_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # kernels/triton/gemv.py GEMV_DTYPES
FUSED_MAX_M = 16  # M <= this: activation quantization fused into the GEMM (one launch)
GEMV_MAX_ELEMS = 64 << 20  # weights of at least this many elements take the fused path at M=1
SCALED_MM_MIN_M = 17  # M >= this: torch._scaled_mm where the probe accepted it


def uses_w8a16_gemv(m: int, n: int, k: int, dtype: torch.dtype) -> bool:
    """[m, k] x [n, k]^T runs the weight-only GEMV: the one path that leaves x unquantized."""
    return m <= W8A16_MAX_M and dtype in W8A16_DTYPES and n * k < GEMV_MAX_ELEMS
