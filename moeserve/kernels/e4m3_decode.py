"""e4m3 weights widened to float32 in registers for the weight-only FP8 GEMVs (gemv.py,
fused_moe_small.py): Triton's cast per byte, or four bytes of an int32 word at a time by integer
ops.

Why the word route: at one row a W8A16 GEMV spends per weight element one FMA plus the widening.
Triton's cast goes through f16 (`cvt` e4m3x2 -> f16x2, then f16 -> f32 per element), and
conversions issue at a fraction of the FMA and integer rate: the H200's FP8 GEMV moved ~11 e4m3
elements per clock per SM (2.98 TB/s on 7168 -> 36864) where conversions at 16 per clock allow
about that. An e4m3fn byte `s eeee mmm` (bias 7) is a float32 with the same sign, exponent and
mantissa bits in the right places: put the byte in the word's top byte (a left shift), shift the
word right arithmetically by 4 (the sign fills bits 31..28) and keep bits 31 and 26..20. That
float32 is the e4m3 value times 2^-120 (bias 127 against 7) for every byte, subnormals included
(an e4m3 subnormal lands on a float32 subnormal with the same mantissa; Triton does not flush
float32 subnormals). The kernels put 2^60 into the activation-side factor they already multiply
by (x times the block scale) and 2^60 into the sum, which keeps every product a normal float32
for activations between 2^-60 and 2^60. Widening a byte this way costs three integer ops (two
for the top byte), which issue at 64 per clock per SM; loading bytes as int8 instead and
sign-extending each (tried first) was slower than the cast: 100.4 against 88.7 µs on 7168 ->
36864, as the extension is itself a conversion.

The word route needs K % 4 == 0 and 4-byte aligned rows (`words_view`); the x slice of a step is
loaded as [..., 2, 2] and split into the four byte columns (`split4`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

HALF_SHIFT = tl.constexpr(2.0**60)  # 2^120 = HALF_SHIFT ** 2: one factor on x's side, one on the sum
_MASK = tl.constexpr(-2014314496)  # 0x87F00000 as int32: the sign bit and bits 26..20


def words_view(w: torch.Tensor) -> torch.Tensor | None:
    """e4m3 w [..., K] as int32 words [..., K / 4] (byte j of word c is column 4c + j, little
    endian), or None where K, the strides or the address do not allow it."""
    if (w.shape[-1] % 4 or w.stride(-1) != 1 or any(s % 4 for s in w.stride()[:-1])
            or w.data_ptr() % 4):
        return None
    return w.view(torch.int32)


@triton.jit
def e4m3_unit(WORDS: tl.constexpr):
    """The factor applied once on the activation side and once on the sum: 2^60 on the word
    route, 1 on the cast."""
    if WORDS:
        return HALF_SHIFT
    return 1.0


@triton.jit
def _byte(v, SHIFT: tl.constexpr):
    """Byte (24 - SHIFT) / 8 of each int32 word as a float32 (its e4m3 value times 2^-120)."""
    if SHIFT == 0:
        top = v
    else:
        top = v << SHIFT
    return ((top >> 4) & _MASK).to(tl.float32, bitcast=True)


@triton.jit
def split4(x):
    """x [..., 2, 2] (column 4c + 2a + b at [c, a, b]) -> its four columns 4c + j, each [...]."""
    even, odd = tl.split(x)
    x0, x2 = tl.split(even)
    x1, x3 = tl.split(odd)
    return x0, x1, x2, x3


@triton.jit
def word_products(v, x0, x1, x2, x3):
    """sum over the four bytes j of each int32 word v of (e4m3 value_j * 2^-120) * xj, with
    xj the activation (already scaled) at column 4c + j; shapes broadcast."""
    p = _byte(v, 24) * x0
    p += _byte(v, 16) * x1
    p += _byte(v, 8) * x2
    p += _byte(v, 0) * x3
    return p
