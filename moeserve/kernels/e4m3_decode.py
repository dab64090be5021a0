"""e4m3 weights widened to float32 in registers, for the weight-only FP8 GEMVs (gemv.py,
fused_moe_small.py): Triton's cast, or the same bits moved by integer ops.

Why the integer route: at one row a W8A16 GEMV spends per weight element one FMA plus the
widening. Triton's cast goes through f16 (`cvt` e4m3x2 -> f16x2, then f16 -> f32 per element),
and conversions issue at a fraction of the FMA rate, so the FP8 GEMV streams well below the bf16
one, whose widening is one shift. An e4m3fn byte `s eeee mmm` (bias 7) is a float32 with the
same sign, exponent and mantissa bits in the right places: sign-extend the byte to int32, shift
it left by 20 and keep bits 31 and 26..20. That float32 is the e4m3 value times 2^-120 (bias 127
against 7) for every byte, subnormals included (an e4m3 subnormal lands on a float32 subnormal
with the same mantissa; Triton does not flush float32 subnormals). The kernels put 2^60 into the
activation-side factor they already multiply by (x times the block scale) and 2^60 into the sum,
which keeps every product a normal float32 for activations between 2^-60 and 2^60.

Both routes give the same float32 products up to the order of the two scalings (exact powers
of two), so a kernel's result is the same either way; `int_decode` on the launch config picks.
Kernels load the weight as int8 (`w.view(torch.int8)`) and call `e4m3_widen`.
"""

from __future__ import annotations

import triton
import triton.language as tl

HALF_SHIFT = tl.constexpr(2.0**60)  # 2^120 = HALF_SHIFT ** 2: one factor on x's side, one on the sum
_MASK = tl.constexpr(-2014314496)  # 0x87F00000 as int32: the sign bit and the 7 exponent/mantissa bits


@triton.jit
def e4m3_widen(w, INT_DECODE: tl.constexpr):
    """int8 bits of e4m3fn -> float32: the value itself (INT_DECODE false: Triton's cast), or
    the value times 2^-120 (true: integer ops; the caller multiplies by `e4m3_unit` twice)."""
    if INT_DECODE:
        return ((w.to(tl.int32) << 20) & _MASK).to(tl.float32, bitcast=True)
    return w.to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def e4m3_unit(INT_DECODE: tl.constexpr):
    """The factor applied once on the activation side and once on the sum: 2^60 (1 for the
    cast)."""
    if INT_DECODE:
        return HALF_SHIFT
    return 1.0
