"""The weight-only FP8 GEMV and small-MoE kernels against float64 on the dequantized weights at
the edges of e4m3 and float32: weight blocks of mostly subnormal bytes (a flushing widening
would zero them), block scales from 2^-20 to 2^4, and activations from 2^-40 to 2^40, in float32
(the other kernel tests on CUDA run bf16, whose rounding would hide such errors). Triton's
interpreter without CUDA, the GPU's own arithmetic with it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
from test_fused_moe import _reference  # noqa: E402
from test_fused_moe_small import _fp8_experts  # noqa: E402

from moeserve.kernels.triton import fused_moe_small as fs  # noqa: E402
from moeserve.kernels.fp8_format import FP8, dequantize_fp8_blocks  # noqa: E402
from moeserve.kernels.triton.gemv import gemv_fp8  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


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


@pytest.mark.parametrize("x_exp", [-40, 0, 40])
@pytest.mark.parametrize("m", [1, 3])
def test_gemv_fp8_subnormal_weights_and_extreme_activations(x_exp, m):
    """float64 within float32 summation error, whatever the magnitudes; K = 300 ends in a
    partial step."""
    n, k = 160, 300
    w_q, scale, w = _subnormal_heavy(n, k, seed=m + x_exp)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(x_exp)) * 2.0**x_exp
    out = gemv_fp8(x.to(DEVICE), w_q.to(DEVICE), scale.to(DEVICE)).double().cpu()
    want = F.linear(x.double(), w.double())
    assert want.abs().max() > 0 and (w_q.float().abs() < 2.0**-6).float().mean() > 0.9
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6 * want.abs().max().item())


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # silu's sigmoid at 2^30
@pytest.mark.parametrize("x_scale", [2.0**-30, 1.0, 2.0**30])
@pytest.mark.parametrize("h,i", [(200, 136), (256, 130)])
def test_small_moe_fp8_matches_float64(x_scale, h, i):
    """fused_moe_small's FP8 gate/up and down kernels, float32 activations: float64 on the
    dequantized experts (silu makes the output nonlinear in x, so each magnitude is its own
    check); partial steps along H or I."""
    t, k, e = 2, 4, 8
    g = torch.Generator().manual_seed(h + i)
    x = torch.randn(t, h, generator=g) * x_scale
    w13 = torch.randn(e, 2 * i, h, generator=g) / h**0.5
    w2 = torch.randn(e, h, i, generator=g) / i**0.5
    ids = torch.rand(t, e, generator=g).argsort(1)[:, :k]
    wts = torch.rand(t, k, generator=g)
    w13_q, w13_s, w2_q, w2_s, w13_d, w2_d = _fp8_experts(w13, w2)
    dev = [a.to(DEVICE) for a in (x, w13_q, w2_q, ids, wts, w13_s, w2_s)]
    out = fs.fused_moe_small(*dev[:5], 0, e, None, *dev[5:]).double().cpu()
    want = _reference(x, w13_d, w2_d, ids, wts, 0)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5 * want.abs().max().item())
