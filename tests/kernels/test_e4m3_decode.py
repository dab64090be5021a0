"""The e4m3 widening (kernels/e4m3_decode.py) against torch's float8_e4m3fn cast for every byte,
and the weight-only FP8 GEMV and small-MoE kernels along both routes against float64 on the
dequantized weights: subnormal-heavy weight blocks, and activations from 2^-40 to 2^40 (the
integer route's 2^60 factors must keep the products normal). Triton's interpreter without CUDA
(float32), the GPU's own arithmetic with it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402
from test_fused_moe import _inputs, _reference  # noqa: E402
from test_fused_moe_small import _fp8_experts  # noqa: E402

from moeserve.kernels import fused_moe_small as fs  # noqa: E402
from moeserve.kernels.e4m3_decode import e4m3_unit, e4m3_widen  # noqa: E402
from moeserve.kernels.fp8_format import FP8, dequantize_fp8_blocks  # noqa: E402
from moeserve.kernels.gemv import GemvConfig, gemv_fp8, gemv_fp8_config  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@triton.jit
def _widen_kernel(w_ptr, out_ptr, INT_DECODE: tl.constexpr):
    offs = tl.arange(0, 256)
    unit = e4m3_unit(INT_DECODE)
    tl.store(out_ptr + offs, e4m3_widen(tl.load(w_ptr + offs), INT_DECODE) * unit * unit)


@pytest.mark.parametrize("int_decode", [True, False])
def test_every_byte_widens_to_torchs_value(int_decode):
    """All 254 finite e4m3fn bytes (zeros, the 7 subnormals per sign, 448) equal torch's cast
    exactly once the factors are applied."""
    bits = torch.arange(-128, 128, dtype=torch.int8)
    out = torch.empty(256, dtype=torch.float32, device=DEVICE)
    _widen_kernel[(1,)](bits.to(DEVICE), out, INT_DECODE=int_decode)
    want = bits.view(FP8).float()
    finite = ~want.isnan()
    assert finite.sum() == 254 and want[finite].abs().max() == 448.0
    assert torch.equal(out.cpu()[finite], want[finite])


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


@pytest.mark.parametrize("int_decode", [True, False])
@pytest.mark.parametrize("x_exp", [-40, 0, 40])
@pytest.mark.parametrize("m", [1, 3])
def test_gemv_fp8_subnormal_weights_and_extreme_activations(int_decode, x_exp, m):
    """Both routes equal float64 within float32 summation error, whatever the magnitudes."""
    n, k = 160, 300
    w_q, scale, w = _subnormal_heavy(n, k, seed=m + x_exp)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(x_exp)) * 2.0**x_exp
    cfg = gemv_fp8_config(n, k, (128, 128), DEVICE)._replace(int_decode=int_decode)
    out = gemv_fp8(x.to(DEVICE), w_q.to(DEVICE), scale.to(DEVICE), config=cfg).double().cpu()
    want = F.linear(x.double(), w.double())
    assert want.abs().max() > 0 and (w_q.float().abs() < 2.0**-6).float().mean() > 0.9
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6 * want.abs().max().item())


@pytest.mark.parametrize("cfg", [GemvConfig(16, 256), GemvConfig(32, 128, 8)])
def test_gemv_fp8_routes_agree(cfg):
    """The two routes on random weights: the same float32 products up to exact power-of-two
    factors, so equal to float32 rounding (the order of the factors differs)."""
    w_q, scale, _ = _subnormal_heavy(96, 1024, seed=7)
    x = torch.randn(2, 1024, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    args = (x, w_q.to(DEVICE), scale.to(DEVICE))
    by_int = gemv_fp8(*args, config=cfg._replace(int_decode=True))
    by_cast = gemv_fp8(*args, config=cfg._replace(int_decode=False))
    torch.testing.assert_close(by_int, by_cast, rtol=1e-6, atol=1e-6 * by_cast.abs().max().item())


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # silu's sigmoid at 2^30
@pytest.mark.parametrize("int_decode", [True, False])
@pytest.mark.parametrize("x_scale", [2.0**-30, 1.0, 2.0**30])
def test_small_moe_fp8_routes_match_float64(int_decode, x_scale):
    """fused_moe_small's FP8 gate/up and down kernels along either route: float64 on the
    dequantized experts (silu makes the output nonlinear in x, so each magnitude is its own
    check)."""
    t, h, i, e, k = 2, 200, 136, 8, 4
    x, w13, w2, ids, wts = _inputs(t, h, i, e, k, seed=3)
    x = x * x_scale
    w13_q, w13_s, w2_q, w2_s, w13_d, w2_d = _fp8_experts(w13, w2)
    base = fs.small_moe_config(t, k, h, i, DEVICE, (128, 128))
    cfg = fs.SmallMoeConfig(base.gate_up._replace(int_decode=int_decode),
                            base.down._replace(int_decode=int_decode))
    dev = [a.to(DEVICE) for a in (x, w13_q, w2_q, ids, wts, w13_s, w2_s)]
    out = fs.fused_moe_small(*dev[:5], 0, e, cfg, *dev[5:]).double().cpu()
    want = _reference(x, w13_d, w2_d, ids, wts, 0)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5 * want.abs().max().item())
