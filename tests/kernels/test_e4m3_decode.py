"""The e4m3 widening (kernels/e4m3_decode.py) against torch's float8_e4m3fn cast for every byte,
and the weight-only FP8 GEMV and small-MoE kernels along both routes (Triton's cast, int32
words) against float64 on the dequantized weights: subnormal-heavy weight blocks, and
activations from 2^-40 to 2^40 (the word route's 2^60 factors must keep the products normal).
Triton's interpreter without CUDA (float32), the GPU's own arithmetic with it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402
from test_fused_moe import _reference  # noqa: E402
from test_fused_moe_small import _fp8_experts  # noqa: E402

from moeserve.kernels import fused_moe_small as fs  # noqa: E402
from moeserve.kernels.e4m3_decode import (  # noqa: E402
    e4m3_unit, split4, word_products, words_view)
from moeserve.kernels.fp8_format import FP8, dequantize_fp8_blocks  # noqa: E402
from moeserve.kernels.gemv import GemvConfig, gemv_fp8, gemv_fp8_config  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@triton.jit
def _widen_kernel(w_ptr, out_ptr):
    """out[4c + j] = byte j of word c, widened: the word route with one-hot activations, the
    four columns split from a [64, 2, 2] tile as the kernels load x."""
    c = tl.arange(0, 64)
    v = tl.load(w_ptr + c)
    unit = e4m3_unit(True)
    cols = (c * 4)[:, None, None] + (tl.arange(0, 2) * 2)[:, None] + tl.arange(0, 2)
    for j in tl.static_range(4):
        x0, x1, x2, x3 = split4(tl.where(cols % 4 == j, unit * unit, 0.0))
        tl.store(out_ptr + c * 4 + j, word_products(v, x0, x1, x2, x3))


def test_every_byte_widens_to_torchs_value():
    """All 254 finite e4m3fn bytes (zeros, the 7 subnormals per sign, 448), at each of the four
    positions of a word, equal torch's cast exactly."""
    out = torch.empty(256, dtype=torch.float32, device=DEVICE)
    for shift in range(4):  # byte b at position (b + shift) % 4 of its word
        bits = torch.arange(-128, 128, dtype=torch.int8).roll(shift)
        words = words_view(bits.view(FP8).to(DEVICE))
        _widen_kernel[(1,)](words, out)
        want = bits.view(FP8).float()
        finite = ~want.isnan()
        assert finite.sum() == 254 and want[finite].abs().max() == 448.0
        assert torch.equal(out.cpu()[finite], want[finite])


def test_words_view_refuses_what_it_cannot_read():
    w = torch.zeros(4, 12, dtype=FP8)
    assert words_view(w).shape == (4, 3) and words_view(w).dtype == torch.int32
    assert words_view(w[:, :10]) is None  # K % 4
    assert words_view(w[:, 1:9]) is None  # address
    assert words_view(torch.zeros(4, 10, dtype=FP8)[:, :8]) is None  # row stride


def _subnormal_heavy(n: int, k: int, seed: int):
    """e4m3 weights [N, K] whose bytes are mostly subnormal (|byte value| < 2^-6) with a few
    448s in each 128 x 128 block, and block scales from 2^-20 to 2^4; (w_q, scale, dequantized)."""
    g = torch.Generator().manual_seed(seed)
    sub = torch.randint(-7, 8, (n, k), generator=g).float() * 2.0**-9  # every subnormal and 0
    big = torch.rand(n, k, generator=g) < 0.02
    sign = torch.where(torch.rand(n, k, generator=g) < 0.5, -1.0, 1.0)
    w_q = torch.where(big, 448.0 * sign, sub).to(FP8)
    scale = 2.0 ** torch.randint(-20, 5, (-(-n // 128), -(-k // 128)), generator=g).float()
    return w_q, scale, dequantize_fp8_blocks(w_q, scale)


@pytest.mark.parametrize("words", [True, False])
@pytest.mark.parametrize("x_exp", [-40, 0, 40])
@pytest.mark.parametrize("m", [1, 3])
def test_gemv_fp8_subnormal_weights_and_extreme_activations(words, x_exp, m):
    """Both routes equal float64 within float32 summation error, whatever the magnitudes; K =
    300 ends in a partial step."""
    n, k = 160, 300
    w_q, scale, w = _subnormal_heavy(n, k, seed=m + x_exp)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(x_exp)) * 2.0**x_exp
    cfg = gemv_fp8_config(n, k, (128, 128), DEVICE)._replace(words=words)
    out = gemv_fp8(x.to(DEVICE), w_q.to(DEVICE), scale.to(DEVICE), config=cfg).double().cpu()
    want = F.linear(x.double(), w.double())
    assert want.abs().max() > 0 and (w_q.float().abs() < 2.0**-6).float().mean() > 0.9
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6 * want.abs().max().item())


@pytest.mark.parametrize("cfg", [GemvConfig(16, 256), GemvConfig(32, 128, 8), GemvConfig(8, 64)])
@pytest.mark.parametrize("k", [1024, 1000, 998])
def test_gemv_fp8_routes_agree(cfg, k):
    """The two routes: the same float32 products up to exact power-of-two factors, so equal to
    float32 rounding (the order of the factors differs); K = 998 cannot be read as words and
    takes the cast."""
    w_q, scale, _ = _subnormal_heavy(96, k, seed=7)
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    args = (x, w_q.to(DEVICE), scale.to(DEVICE))
    by_words = gemv_fp8(*args, config=cfg._replace(words=True))
    by_cast = gemv_fp8(*args, config=cfg._replace(words=False))
    torch.testing.assert_close(by_words, by_cast, rtol=1e-5,
                               atol=1e-6 * by_cast.abs().max().item())


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # silu's sigmoid at 2^30
@pytest.mark.parametrize("words", [True, False])
@pytest.mark.parametrize("x_scale", [2.0**-30, 1.0, 2.0**30])
@pytest.mark.parametrize("h,i", [(200, 136), (256, 130)])
def test_small_moe_fp8_routes_match_float64(words, x_scale, h, i):
    """fused_moe_small's FP8 gate/up and down kernels along either route, float32 activations:
    float64 on the dequantized experts (silu makes the output nonlinear in x, so each magnitude
    is its own check); partial steps along H or I (I = 130 is not a multiple of 4: the down
    kernel takes the cast there)."""
    t, k, e = 2, 4, 8
    g = torch.Generator().manual_seed(h + i)
    x = torch.randn(t, h, generator=g) * x_scale
    w13 = torch.randn(e, 2 * i, h, generator=g) / h**0.5
    w2 = torch.randn(e, h, i, generator=g) / i**0.5
    ids = torch.rand(t, e, generator=g).argsort(1)[:, :k]
    wts = torch.rand(t, k, generator=g)
    w13_q, w13_s, w2_q, w2_s, w13_d, w2_d = _fp8_experts(w13, w2)
    base = fs.small_moe_config(t, k, h, i, DEVICE, (128, 128))
    cfg = fs.SmallMoeConfig(base.gate_up._replace(words=words), base.down._replace(words=words))
    dev = [a.to(DEVICE) for a in (x, w13_q, w2_q, ids, wts, w13_s, w2_s)]
    out = fs.fused_moe_small(*dev[:5], 0, e, cfg, *dev[5:]).double().cpu()
    want = _reference(x, w13_d, w2_d, ids, wts, 0)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5 * want.abs().max().item())
