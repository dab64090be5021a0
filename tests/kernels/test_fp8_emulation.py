"""The FP8 Triton path, layer by layer, against its float64 emulation (layers/fp8_emulation.py):
the same e4m3 weight blocks and scales, the same per-token-group activation quantization where
the kernel quantizes, everything else in float64. Fed the same input, the two may differ only by
the kernels' float32 accumulation and the rounding of the output to the activation dtype:
- CPU (Triton's interpreter, float32): to float32 accumulation (measured ~2e-7);
- GPU (bf16, @pytest.mark.gpu): to bf16's output rounding (< 2^-9 an element).
Each check also shows that the tolerance separates: the same layer without activation
quantization (the dequantized reference) is ~100x further away. Shapes have partial 128 x 128
blocks in N and K, a merged linear whose second shard starts mid-block, EP-local experts, and
each path of `fp8_linear` / `fused_moe` (W8A16 GEMV, fused quantization, Triton GEMM,
torch._scaled_mm and TMA on the GPU; the small and the sorted fused MoE)."""

from __future__ import annotations

import json

import pytest
import torch
from test_fused_moe import LaunchSpy

from moeserve.kernels.fp8_format import quantize_fp8_blocks
from moeserve.kernels.triton import fp8 as fp8_kernels
from moeserve.kernels.triton import fused_moe as fm
from moeserve.kernels.triton.fused_moe_small import SMALL_MAX_PAIRS
from moeserve.kernels.triton.moe_config import config_file_name, get_moe_config
from moeserve.layers.fp8_emulation import (
    dequantize_weight,
    emulate_fp8_matmul,
    quantize_activations,
)
from moeserve.layers.fp8_linear import GEMV_MAX_ELEMS, Fp8Linear, Fp8MergedLinear, fp8_gemm_path
from moeserve.layers.fp8_moe import Fp8MoEExperts

# relative tolerance to the emulation: CPU (float32), GPU (bf16) with the FP8 tiles widened to
# bf16 before tl.dot (EXACT_DOT), GPU as served
CPU_TOL, EXACT_GPU_TOL, GPU_TOL = 2e-6, 1e-4, 4e-3


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm())


def _linear(n: int, k: int, device: str, seed: int = 0, merged: list[int] | None = None):
    g = torch.Generator().manual_seed(seed)
    if merged:
        layer = Fp8MergedLinear(k, merged, [f"s{i}" for i in range(len(merged))], bias=True,
                                bias_dtype=torch.float32)
        for i, size in enumerate(merged):
            q, s = quantize_fp8_blocks(torch.randn(size, k, generator=g) * 0.05)
            layer.weight_loader(layer.weight, q, f"s{i}")
            layer.weight_loader(layer.weight_scale_inv, s, f"s{i}")
    else:
        layer = Fp8Linear(k, n, bias=True, bias_dtype=torch.float32)
        q, s = quantize_fp8_blocks(torch.randn(n, k, generator=g) * 0.05)
        layer.weight.data.copy_(q)
        layer.weight_scale_inv.data.copy_(s)
    layer.bias.data.copy_(torch.randn(layer.out_features, generator=g) * 0.1)
    return layer.to(device)


def _experts(device: str, h: int = 320, inter: int = 200, seed: int = 0) -> Fp8MoEExperts:
    """8 of 12 experts local (ids 2..9), H and I with partial blocks."""
    g = torch.Generator().manual_seed(seed)
    mod = Fp8MoEExperts(12, h, inter, first_expert=2, num_local=8, backend="triton")
    for e in range(8):
        for shard, dest_rows in (("gate", slice(0, inter)), ("up", slice(inter, 2 * inter))):
            q, s = quantize_fp8_blocks(torch.randn(inter, h, generator=g) * 0.05)
            mod.w13.data[e, dest_rows] = q
            rows = mod.gate_scale_rows
            (mod.w13_scale_inv.data[e, :rows] if shard == "gate"
             else mod.w13_scale_inv.data[e, rows:]).copy_(s)
        q, s = quantize_fp8_blocks(torch.randn(h, inter, generator=g) * 0.05)
        mod.w2.data[e] = q
        mod.w2_scale_inv.data[e] = s
    return mod.to(device)


def _routing(t: int, k: int, seed: int, device: str):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(12, generator=g)[:k] for _ in range(t)])
    w = torch.rand(t, k, generator=g)
    return ids.to(device), (w / w.sum(1, keepdim=True)).to(device)


def _run(module, backend: str, *args):
    saved, module.backend = module.backend, backend
    try:
        return module(*args)
    finally:
        module.backend = saved


def _check_linear(layer, m: int, device: str, dtype: torch.dtype, tol: float) -> None:
    x = (torch.randn(m, layer.in_features, generator=torch.Generator().manual_seed(m)) * 2
         ).to(device, dtype)
    out = _run(layer, "triton", x)
    emu = _run(layer, "emulate", x)
    # the dequantized weights with x as it is (not quantized)
    ref = x.double() @ layer.dequantized().double().t() + layer.bias.double()
    err, ref_err = _rel(out, emu), _rel(ref, emu)
    path = fp8_gemm_path(m, layer.out_features, layer.in_features, layer.block, dtype,
                         torch.device(device))
    print(f"\n[fp8 emu] linear {layer.in_features}->{layer.out_features} M={m} {path}: "
          f"kernel vs emulation {err:.2e}, unquantized vs emulation {ref_err:.2e}")
    assert err < tol
    if path != "gemv":  # the emulation quantizes: the kernel is far nearer it than the unquantized
        assert ref_err > 20 * max(err, CPU_TOL)


def _check_moe(mod, t: int, device: str, dtype: torch.dtype, tol: float) -> None:
    x = (torch.randn(t, mod.w13.shape[2], generator=torch.Generator().manual_seed(t))
         ).to(device, dtype)
    ids, w = _routing(t, 4, t, device)
    out, emu = _run(mod, "triton", x, ids, w), _run(mod, "emulate", x, ids, w)
    ref = _run(mod, "torch", x.float(), ids, w)  # dequantized experts, x as it is
    small = t * 4 <= SMALL_MAX_PAIRS
    err, ref_err = _rel(out, emu), _rel(ref, emu)
    print(f"\n[fp8 emu] moe T={t} {'small' if small else 'sorted'}: kernel vs emulation "
          f"{err:.2e}, unquantized vs emulation {ref_err:.2e}")
    assert err < tol
    if not small:
        assert ref_err > 20 * max(err, CPU_TOL)


def test_emulated_quantization_and_dequantization_follow_the_format():
    """Values worked out by hand on the e4m3 grid (3 mantissa bits, max 448)."""
    x = torch.tensor([[4.48, -0.0123, 0.0, 1e-3] + [0.0] * 124 + [7.97, 8.0, -1.0]])
    xa = quantize_activations(x, 128)  # groups of 128: scales 4.48 / 448 and 8 / 448
    assert float(xa[0, 0]) == pytest.approx(4.48, rel=1e-6)  # 448 on the grid
    assert float(xa[0, 1]) == pytest.approx(-0.0125, rel=1e-6)  # -1.23 -> -1.25
    assert float(xa[0, 3]) == pytest.approx(13 / 128 * 0.01, rel=1e-6)  # 0.1 -> 13 * 2^-7
    assert float(xa[0, 128]) == pytest.approx(8.0, rel=1e-6)  # 446.3 -> 448 (carry)
    assert float(xa[0, 130]) == pytest.approx(-1.0, rel=1e-6)  # -56 exactly
    w = torch.tensor([[1.0, 2.0, 3.0]]).repeat(130, 1).to(torch.float8_e4m3fn)
    s = torch.tensor([[0.5], [4.0]])  # two row blocks of 128: the second is partial
    d = dequantize_weight(w, s, (128, 128))
    assert d[127].tolist() == [0.5, 1.0, 1.5] and d[128].tolist() == [4.0, 8.0, 12.0]
    out = emulate_fp8_matmul(torch.ones(1, 3), w, s, (128, 128), quantize=False)
    assert out[0, 0] == 3.0 and out[0, 129] == 24.0


@pytest.mark.parametrize("m", [1, 5, 40])
def test_linear_kernels_equal_the_emulation_in_float32_interpreter(m):
    if torch.cuda.is_available():
        pytest.skip("the CPU interpreter's check (the GPU one is below)")
    _check_linear(_linear(200, 320, "cpu"), m, "cpu", torch.float32, CPU_TOL)
    _check_linear(_linear(0, 320, "cpu", merged=[200, 72]), m, "cpu", torch.float32, CPU_TOL)


@pytest.mark.parametrize("t", [3, 20])
def test_fused_moe_equals_the_emulation_in_float32_interpreter(t):
    if torch.cuda.is_available():
        pytest.skip("the CPU interpreter's check (the GPU one is below)")
    _check_moe(_experts("cpu"), t, "cpu", torch.float32, CPU_TOL)


def _check_moe_swap_ab(tmp_path, t: int, device: str, dtype: torch.dtype, tol: float,
                       flags: dict | None = None) -> None:
    """Swap-AB tiles from a tuned table (fused_moe.py): activation scales per column, weight
    block scales per row; 128-wide weight tiles over partial blocks (I 200, H 320). `flags`
    replace the tile's (B_TMA: the e4m3 weight tiles by TMA where rows allow, here H 320)."""
    tile = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=128, BLOCK_SIZE_K=64, GROUP_SIZE_M=1, num_warps=4,
                num_stages=2, SWAP_AB=1) | (flags or {})
    (tmp_path / config_file_name(8, 320, 200, dtype)).write_text(json.dumps({str(t): tile}))
    mod = _experts(device)
    mod.config_dir = str(tmp_path)
    assert get_moe_config(8, 320, 200, 4, dtype, t, mod.config_dir) == tile  # the layer's lookup
    _check_moe(mod, t, device, dtype, tol)


def test_fused_moe_swap_ab_equals_the_emulation_in_float32_interpreter(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("the CPU interpreter's check (the GPU one is below)")
    _check_moe_swap_ab(tmp_path, 20, "cpu", torch.float32, CPU_TOL)


@pytest.mark.parametrize("swap", [0, 1])
def test_fused_moe_tma_equals_the_emulation_in_float32_interpreter(tmp_path, swap, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("the CPU interpreter's check (the GPU one is below)")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    spy = LaunchSpy(fm._moe_gemm_kernel, "B_TMA")
    monkeypatch.setattr(fm, "_moe_gemm_kernel", spy)
    _check_moe_swap_ab(tmp_path, 20, "cpu", torch.float32, CPU_TOL, dict(SWAP_AB=swap, B_TMA=1))
    assert spy.launches == [1, 0]  # gate/up rows of 320 e4m3 bytes by TMA; down's 200 cannot


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 5, 40, 300])
def test_linear_kernels_equal_the_emulation_in_bf16_on_gpu(m, monkeypatch):
    with monkeypatch.context() as mp:  # float32 accumulation: only the output rounding differs
        mp.setattr(fp8_kernels, "EXACT_DOT", True)
        _check_linear(_linear(200, 320, "cuda"), m, "cuda", torch.bfloat16, EXACT_GPU_TOL)
        _check_linear(_linear(640, 7168, "cuda"), m, "cuda", torch.bfloat16, EXACT_GPU_TOL)
    # as served: Hopper's FP8 wgmma accumulator adds ~7e-4 at M >= 17 (docs/fp8.md)
    _check_linear(_linear(200, 320, "cuda"), m, "cuda", torch.bfloat16, GPU_TOL)
    _check_linear(_linear(0, 320, "cuda", merged=[200, 72]), m, "cuda", torch.bfloat16, GPU_TOL)
    # DeepSeek-like K (a multiple of 512: torch._scaled_mm where the probe accepts it) with a
    # partial last row block, and at M = 1 a weight past GEMV_MAX_ELEMS (the fused TMA kernel)
    _check_linear(_linear(576 + 64, 1536, "cuda"), m, "cuda", torch.bfloat16, GPU_TOL)
    if m == 1:
        assert 9472 * 7168 >= GEMV_MAX_ELEMS
        _check_linear(_linear(9472, 7168, "cuda"), m, "cuda", torch.bfloat16, GPU_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 3, 20, 100])
def test_fused_moe_equals_the_emulation_in_bf16_on_gpu(t):
    _check_moe(_experts("cuda"), t, "cuda", torch.bfloat16, GPU_TOL)


SWAP_GPU_MISS = ("H100, 2026-12-07: the swapped kernel is within GPU_TOL of the emulation "
                 "(3.4-3.6e-3) but the FP8 effect (4.2-4.3e-2) is only ~12x that, where the "
                 "non-swapped kernel is under 1/20 of it; not understood yet, swap-AB is off by "
                 "default (docs/gpu_decode.md)")


@pytest.mark.gpu
@pytest.mark.parametrize("t", [20, 300])
def test_fused_moe_tma_equals_the_emulation_in_bf16_on_gpu(t, tmp_path):
    _check_moe_swap_ab(tmp_path, t, "cuda", torch.bfloat16, GPU_TOL, dict(SWAP_AB=0, B_TMA=1))


@pytest.mark.gpu
@pytest.mark.xfail(strict=True, reason=SWAP_GPU_MISS)
@pytest.mark.parametrize("t", [20, 300])
def test_fused_moe_swap_ab_equals_the_emulation_in_bf16_on_gpu(t, tmp_path):
    _check_moe_swap_ab(tmp_path, t, "cuda", torch.bfloat16, GPU_TOL)
