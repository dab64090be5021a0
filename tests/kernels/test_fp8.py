"""Block-scaled FP8 kernels against float64 references on the dequantized values (partial 128
blocks included), in Triton's interpreter on CPU and on CUDA when present. The interpreter's own
float32 -> e4m3 cast is wrong where rounding carries or ties; the kernels round exactly there
(`EXACT_E4M3`), so their quantized values equal torch's cast on CPU too."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import triton

from moeserve.kernels.triton import fp8
from moeserve.kernels.triton.fp8 import (GemmConfig, fp8_block_matmul, fp8_quant_matmul,
                                         fused_config, quant_fp8_per_token_group)
from moeserve.kernels.fp8_format import FP8, FP8_MAX, dequantize_fp8_blocks, quantize_fp8_blocks
from moeserve.layers.fp8_linear import fp8_linear

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _dequant_rows(x_q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x_q [T, K] with scale [T, ceil(K/128)] → float64 [T, K]."""
    k = x_q.shape[1]
    return x_q.double() * scale.double().repeat_interleave(128, 1)[:, :k]


@pytest.mark.parametrize("t,k", [(1, 128), (5, 300), (17, 64), (0, 256)])
def test_per_token_group_quant(t, k):
    x = torch.randn(t, k, generator=torch.Generator().manual_seed(t + k)).to(DEVICE) * 3
    x[:, :7] *= 40  # groups with outliers
    x_q, s = quant_fp8_per_token_group(x)
    assert x_q.dtype == torch.float8_e4m3fn and s.shape == (t, -(-k // 128))
    if t == 0:
        return
    groups = torch.nn.functional.pad(x.abs(), (0, s.shape[1] * 128 - k)).view(t, -1, 128)
    torch.testing.assert_close(s, groups.amax(-1) / FP8_MAX, rtol=1e-6, atol=0)
    err = (_dequant_rows(x_q, s) - x.double()).abs()
    bound = x.double().abs() / 16 + s.double().repeat_interleave(128, 1)[:, :k] * 2**-9
    assert (err <= bound).all()  # e4m3: 3 mantissa bits, half an ulp; subnormals absolute
    if DEVICE == "cuda":  # the Triton kernel (on CPU the torch ops run: the interpreter's e4m3
        from moeserve.kernels.triton.fp8 import _quant_torch  # cast is wrong for some values)

        ref_q, ref_s = _quant_torch(x, 128, s.shape[1])
        torch.testing.assert_close(s, ref_s, rtol=1e-6, atol=0)
        assert (x_q.float() != ref_q.float()).float().mean() < 1e-3  # division rounding ties


@pytest.mark.parametrize("t,n,k", [(1, 128, 128), (5, 200, 300), (37, 384, 256), (70, 96, 200)])
def test_block_matmul_equals_float64_on_dequantized_operands(t, n, k):
    g = torch.Generator().manual_seed(t * n + k)
    x = torch.randn(t, k, generator=g).to(DEVICE)
    w = (torch.randn(n, k, generator=g) * 0.05).to(DEVICE)
    w_q, w_s = quantize_fp8_blocks(w)
    assert w_s.shape == (-(-n // 128), -(-k // 128))
    x_q, x_s = quant_fp8_per_token_group(x)
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    out = fp8_block_matmul(x_q, x_s, w_q, w_s, out_dtype=dtype)
    ref = _dequant_rows(x_q, x_s) @ dequantize_fp8_blocks(w_q, w_s).double().T
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert float((out.double() - ref).norm() / ref.norm()) < tol


@pytest.mark.parametrize("block,cfg", [
    ((128, 128), GemmConfig(block_m=16, block_n=64, split_k=3)),  # 3 K splits of 1, 1, 1 groups
    ((128, 128), GemmConfig(block_m=32, block_n=128, split_k=2)),
    ((64, 64), GemmConfig(block_m=16, block_n=128, split_k=4)),  # a tile spans 2 scale rows
    ((32, 128), GemmConfig(block_m=16, block_n=64, split_k=1)),
    ((128, 128), GemmConfig(block_m=16, block_n=128, split_k=2, swap_ab=True)),  # w @ x^T
    ((64, 64), GemmConfig(block_m=16, block_n=64, split_k=3, swap_ab=True)),
])
def test_block_matmul_split_k_and_other_blocks(block, cfg):
    """K split over programs (fp32 partials summed) and non-128 blocks; written into a column
    slice of a wider output (as Fp8MergedLinear does per shard)."""
    t, n, k = 5, 200, 300
    g = torch.Generator().manual_seed(11)
    x = torch.randn(t, k, generator=g).to(DEVICE)
    w_q, w_s = quantize_fp8_blocks((torch.randn(n, k, generator=g) * 0.05).to(DEVICE), block)
    assert w_s.shape == (-(-n // block[0]), -(-k // block[1]))
    x_q, x_s = quant_fp8_per_token_group(x, block[1])
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    wide = torch.full((t, n + 30), 7.0, dtype=dtype, device=DEVICE)
    fp8_block_matmul(x_q, x_s, w_q, w_s, block=block, config=cfg, out=wide[:, 10 : 10 + n])
    xd = x_q.double() * x_s.double().repeat_interleave(block[1], 1)[:, :k]
    ref = xd @ dequantize_fp8_blocks(w_q, w_s, block).double().T
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert float((wide[:, 10 : 10 + n].double() - ref).norm() / ref.norm()) < tol
    assert (wide[:, :10] == 7).all() and (wide[:, 10 + n :] == 7).all()


def _rounding_cases(t: int, k: int, gen) -> torch.Tensor:
    """[t, k] with every group's amax 448 (scale exactly 1): e4m3 midpoints (ties), values that
    round up into the next binade (7.97, 127.6), random values and zeros."""
    grid = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    grid = grid[grid.isfinite() & (grid >= 0)].sort().values
    special = torch.cat([(grid[1:] + grid[:-1]) / 2, grid * (1 - 2**-6), torch.zeros(3)])
    x = (torch.randn(t, k, generator=gen) * 50).clamp(-440, 440)
    x.view(-1)[: special.numel()] = special[torch.randperm(special.numel(), generator=gen)]
    x *= torch.where(torch.rand(t, k, generator=gen) < 0.5, -1.0, 1.0)
    x[:, ::128] = 448.0
    return x


@pytest.mark.parametrize("col_major,pad", [(False, 0), (True, 0), (True, 3)])
def test_quant_kernel_rounds_like_the_cast_in_any_scale_layout(col_major, pad):
    """The Triton quantization kernel (also in the interpreter) against torch: ties to even and
    binade carries; scales written column-major for torch._scaled_mm; padded rows zero."""
    t, k = 9, 300
    x = _rounding_cases(t, k, torch.Generator().manual_seed(pad)).to(DEVICE)
    rows, groups = t + pad, 3
    x_q = torch.empty((rows, k), dtype=FP8, device=DEVICE)
    scale = (torch.empty((groups, rows), device=DEVICE).t() if col_major
             else torch.empty((rows, groups), device=DEVICE))
    fp8._launch_quant(x, x_q, scale, 128)
    ref_q, ref_s = fp8._quant_torch(x, 128, groups)
    assert torch.equal(scale[:t], ref_s)
    mismatch = (x_q[:t].float() != ref_q.float()).float().mean()
    assert mismatch == 0 if DEVICE == "cpu" else mismatch < 1e-3  # CUDA: approximate division
    assert (x_q[t:].float() == 0).all()  # padding rows: zero values, the floor scale
    assert torch.allclose(scale[t:], torch.full_like(scale[t:], 1e-10 / FP8_MAX), rtol=1e-6)
    q2, s2 = quant_fp8_per_token_group(x, col_major=col_major, rows=rows)  # the public entry
    assert s2.stride() == ((1, rows) if col_major else (groups, 1))
    assert torch.equal(q2.float(), x_q.float()) or DEVICE == "cuda"
    assert torch.equal(s2, scale)


@pytest.mark.parametrize("t,n,k,block,cfg", [
    (1, 200, 300, (128, 128), GemmConfig(16, 128)),  # partial K and N blocks
    (5, 200, 300, (128, 128), GemmConfig(16, 64, split_k=3)),  # 3 splits of one group
    (1, 576, 1024, (128, 128), GemmConfig(16, 64, split_k=8)),  # kv_a-like: 9 x 8 programs
    (16, 96, 640, (128, 128), GemmConfig(16, 32, split_k=2)),  # 5 groups: splits of 3 and 2
    (3, 100, 200, (64, 64), GemmConfig(16, 64, split_k=2)),  # a tile spans 2 scale rows
    (1, 200, 300, (128, 128), GemmConfig(16, 128, swap_ab=True)),  # decode's w @ x^T tiles
    (5, 300, 1024, (128, 128), GemmConfig(16, 128, split_k=4, swap_ab=True)),
    (16, 96, 640, (128, 128), GemmConfig(16, 64, split_k=2, swap_ab=True)),
    (3, 100, 200, (64, 64), GemmConfig(16, 64, split_k=2, swap_ab=True)),
])
def test_fused_quant_matmul_equals_quantize_then_gemm(t, n, k, block, cfg):
    """Activations quantized inside the GEMM (decode's single launch) give exactly the result of
    the quantization kernel + the GEMM at the same config, split-K (fp32 partials added in the
    same launch) included; float64 reference on the dequantized operands."""
    g = torch.Generator().manual_seed(t * n + k)
    x = (torch.randn(t, k, generator=g) * 3).to(DEVICE)
    x[:, :7] *= 40  # outliers
    w_q, w_s = quantize_fp8_blocks((torch.randn(n, k, generator=g) * 0.05).to(DEVICE), block)
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    x = x.to(dtype)
    fused = fp8_quant_matmul(x, w_q, w_s, block, config=cfg)
    x_q, x_s = quant_fp8_per_token_group(x, block[1])
    if DEVICE == "cuda":  # the same kernel's quantization, not torch's
        x_q, x_s = torch.empty_like(x_q), torch.empty_like(x_s)
        fp8._launch_quant(x, x_q, x_s, block[1])
    separate = fp8_block_matmul(x_q, x_s, w_q, w_s, dtype, block, config=cfg)
    assert fused.dtype == dtype and torch.equal(fused, separate)
    ref = (x_q.double() * x_s.double().repeat_interleave(block[1], 1)[:, :k]
           @ dequantize_fp8_blocks(w_q, w_s, block).double().T)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert float((fused.double() - ref).norm() / ref.norm()) < tol
    assert torch.count_nonzero(fp8._split_counters(x.device)) == 0  # reset for the next launch
    assert torch.equal(fp8_quant_matmul(x, w_q, w_s, block, config=cfg), fused)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="TMA descriptors need CUDA (sm90+)")
@pytest.mark.parametrize("t,n,k,cfg", [
    (1, 200, 1024, GemmConfig(16, 128, swap_ab=True)),  # a partial N tile: TMA's zero fill
    (1, 576, 7168, GemmConfig(16, 128, split_k=8, num_stages=4, swap_ab=True)),  # kv_a-like
    (1, 1000, 2112, GemmConfig(16, 64, swap_ab=True)),  # a partial K group (2112 = 16.5 x 128)
    (5, 300, 1024, GemmConfig(16, 128, split_k=4, swap_ab=True)),
    (3, 256, 512, GemmConfig(16, 64, split_k=2)),  # x tile as the A operand
])
def test_tma_weight_loads_equal_pointer_loads(t, n, k, cfg):
    """GemmConfig.tma reads the weight tiles through a TMA descriptor: the same products as the
    pointer loads, bit for bit, and the float64 reference on the dequantized operands."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs sm90+")
    g = torch.Generator().manual_seed(t * n + k)
    x = (torch.randn(t, k, generator=g) * 3).to("cuda", torch.bfloat16)
    w_q, w_s = quantize_fp8_blocks((torch.randn(n, k, generator=g) * 0.05).cuda())
    assert fp8.tma_ok(w_q)
    plain = fp8_quant_matmul(x, w_q, w_s, config=cfg)
    tma = fp8_quant_matmul(x, w_q, w_s, config=dataclasses.replace(cfg, tma=True))
    assert torch.equal(tma, plain)
    x_q, x_s = torch.empty((t, k), dtype=FP8, device="cuda"), torch.empty(
        (t, triton.cdiv(k, 128)), dtype=torch.float32, device="cuda")
    fp8._launch_quant(x, x_q, x_s, 128)
    ref = _dequant_rows(x_q, x_s) @ dequantize_fp8_blocks(w_q, w_s).double().T
    assert float((tma.double() - ref).norm() / ref.norm()) < 1e-2
    assert torch.count_nonzero(fp8._split_counters(x.device)) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(64, 256, 512), (300, 576, 7168), (17, 24576, 1536)])
def test_deep_gemm_linear_equals_float64_on_quantized_operands(m, n, k):
    """model.fp8_gemm=deep_gemm (kernels/deepgemm_linear.py), where DeepGEMM is installed: the
    float64 product of the quantized activations and dequantized weights, and `fp8_linear`
    routes prefill sizes to it."""
    from moeserve.kernels.deepgemm_linear import deep_gemm_linear, deep_gemm_module

    if DEVICE != "cuda" or deep_gemm_module() is None:
        pytest.skip("needs CUDA and deep_gemm")
    g = torch.Generator().manual_seed(m + n + k)
    x = (torch.randn(m, k, generator=g) * 3).to("cuda", torch.bfloat16)
    w_q, w_s = quantize_fp8_blocks((torch.randn(n, k, generator=g) * 0.05).cuda())
    out = deep_gemm_linear(x, w_q, w_s)
    x_q, x_s = quant_fp8_per_token_group(x)
    ref = _dequant_rows(x_q, x_s) @ dequantize_fp8_blocks(w_q, w_s).double().T
    assert out.dtype == torch.bfloat16
    assert float((out.double() - ref).norm() / ref.norm()) < 1e-2
    assert torch.equal(fp8_linear(x, w_q, w_s, deep_gemm=True), out)


def test_fused_config_streams_the_weights_on_every_sm(monkeypatch):
    """Decode on DeepSeek-V3's shapes (132 SMs), 16 rows and one row (the large weights at batch
    1): at least one program per SM (the 128-row tiles of 7168 -> 576 are 5), each split >= 2 K
    groups; one row swaps the operands (the weight tile fills the wgmma rows)."""
    monkeypatch.setattr(fp8, "_num_sms", lambda index: 132)
    shapes = {16: [(7168, 18432), (7168, 1536), (1536, 24576), (7168, 576), (16384, 7168)],
              1: [(7168, 36864), (18432, 7168), (16384, 7168), (1536, 24576)]}
    for rows, pairs in shapes.items():
        for k, n in pairs:
            cfg = fused_config(n, k, 128, torch.device("cuda", 0), rows)
            groups = k // 128
            split = triton.cdiv(groups, triton.cdiv(groups, cfg.split_k))  # as launched
            programs = triton.cdiv(n, cfg.block_n) * split
            assert programs >= 132 and groups // split >= 2, (k, n, cfg)
            assert cfg.swap_ab == (rows == 1)
    assert fused_config(576, 7168, 128, torch.device("cpu")).split_k == 1  # interpreter


def test_weight_blocks_round_trip_through_the_checkpoint_dequantizer():
    """Our quantizer writes what the loader reads: dequantized within e4m3 rounding."""
    w = torch.randn(200, 300, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    w_q, w_s = quantize_fp8_blocks(w)
    back = dequantize_fp8_blocks(w_q, w_s)
    block_scale = w_s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:200, :300]
    assert ((back - w).abs() <= w.abs() / 16 + block_scale * 2**-9).all()


def test_fp8_linear_close_to_the_bf16_linear():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 4, 300, generator=g).to(DEVICE)
    w = (torch.randn(200, 300, generator=g) * 0.05).to(DEVICE)
    b = torch.randn(200, generator=g).to(DEVICE)
    w_q, w_s = quantize_fp8_blocks(w)
    out = fp8_linear(x, w_q, w_s, b)
    ref = torch.nn.functional.linear(x.double(), w.double(), b.double())
    assert out.shape == (3, 4, 200)
    assert float((out.double() - ref).norm() / ref.norm()) < 0.05  # two e4m3 roundings


def _fp8_experts(e: int, rows: int, cols: int, gen, shards: int = 1):
    """e experts of [rows, cols] quantized in 128 x 128 blocks, each of `shards` row shards
    (w13: gate, up) blocked on its own as checkpoints store them: (w_q [e, rows, cols] fp8,
    scales [e, shards * ceil(rows / shards / 128), ceil(cols/128)], dequantized float64)."""
    ws = [torch.randn(rows, cols, generator=gen) / cols**0.5 for _ in range(e)]
    qs = [[quantize_fp8_blocks(part.to(DEVICE)) for part in w.chunk(shards)] for w in ws]
    w_q = torch.stack([torch.cat([q for q, _ in parts]) for parts in qs])
    scales = torch.stack([torch.cat([s for _, s in parts]) for parts in qs])
    deq = torch.stack([torch.cat([dequantize_fp8_blocks(q, s).double().cpu() for q, s in parts])
                       for parts in qs])
    return w_q, scales, deq


@pytest.mark.parametrize("t,k,first,num_local,i", [(1, 2, 0, 6, 72), (9, 4, 0, 6, 72),
                                                  (40, 2, 3, 4, 72), (9, 2, 2, 4, 200)])
def test_fp8_fused_moe_equals_float64_on_dequantized_weights(t, k, first, num_local, i):
    """Partial blocks (H 200, I 72 or 200: gate's last block partial, up blocked apart),
    EP-local masking (ids outside [first, first + num_local))."""
    from moeserve.kernels.triton.fused_moe import fused_moe

    h, e_global = 200, 10
    g = torch.Generator().manual_seed(t * 7 + k)
    w13_q, w13_s, w13 = _fp8_experts(num_local, 2 * i, h, g, shards=2)
    w2_q, w2_s, w2 = _fp8_experts(num_local, h, i, g)
    x = torch.randn(t, h, generator=g).to(DEVICE)
    ids = torch.rand(t, e_global, generator=g).argsort(1)[:, :k].to(DEVICE)
    w = torch.rand(t, k, generator=g).to(DEVICE)
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    cfg = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=64, GROUP_SIZE_M=1, num_warps=4,
               num_stages=2)
    out = fused_moe(x.to(dtype), w13_q, w2_q, ids, w, first, num_local, cfg, w13_s, w2_s,
                    small_path=False)  # the sorted path (test_fused_moe_small: the GEMV one)
    # reference: the same activation quantization, float64 products on dequantized weights
    x_q, x_s = quant_fp8_per_token_group(x.to(dtype))
    xd = _dequant_rows(x_q, x_s).cpu()
    ref = torch.zeros(t, h, dtype=torch.float64)
    for tok in range(t):
        for j in range(k):
            e = int(ids[tok, j]) - first
            if not 0 <= e < num_local:
                continue
            gu = w13[e] @ xd[tok]
            inter = torch.nn.functional.silu(gu[:i]) * gu[i:]
            iq, i_s = quant_fp8_per_token_group(inter[None].float().to(DEVICE))
            ref[tok] += float(w[tok, j]) * (w2[e] @ _dequant_rows(iq, i_s).cpu()[0])
    tol = 1e-4 if dtype == torch.float32 else 5e-2  # fp32: only rounding flips of the intermediate
    assert out.shape == (t, h) and out.dtype == dtype
    err = float((out.double().cpu() - ref).norm() / ref.norm())
    print(f"fp8 fused moe rel err {err:.2e}")
    assert err < tol
