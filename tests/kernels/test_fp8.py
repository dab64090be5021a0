"""Block-scaled FP8 kernels against float64 references on the dequantized values (partial 128
blocks included), in Triton's interpreter on CPU and on CUDA when present."""

from __future__ import annotations

import pytest
import torch

from moeserve.kernels.fp8 import (GemmConfig, fp8_block_matmul, fp8_linear,
                                  quant_fp8_per_token_group)
from moeserve.kernels.fp8_format import FP8_MAX, dequantize_fp8_blocks, quantize_fp8_blocks

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
        from moeserve.kernels.fp8 import _quant_torch  # cast is wrong for some values)

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
    from moeserve.kernels.fused_moe import fused_moe

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
    out = fused_moe(x.to(dtype), w13_q, w2_q, ids, w, first, num_local, cfg, w13_s, w2_s)
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
