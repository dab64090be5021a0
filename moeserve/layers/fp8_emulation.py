"""A float64 emulation of the FP8 Triton path's arithmetic, to measure its accuracy against.

The FP8 path (`backend="triton"`, docs/fp8.md) rounds in three places: the weights are e4m3 with
a float32 scale per block (stored), the activations are quantized per token and group of bk
channels (scale = amax / 448 in float32, values rounded to e4m3) where the kernel quantizes, and
every tensor a kernel stores is rounded to the activation dtype (the output; the fused MoE's
silu(gate) * up intermediate and its per-pair down outputs). Everything else (products, sums)
the kernels do in float32 with their own order. This module does those roundings exactly as
specified and the rest in float64, independently of the kernels' code (torch's float32 -> e4m3
cast is the rounding oracle), choosing per call which arithmetic applies as the kernels'
dispatch does: the W8A16 GEMV and the small-batch fused MoE (`fused_moe_small`) keep x in its
dtype, the other paths quantize it. So a kernel and its emulation, fed the same input, differ
only by float32 accumulation and the final rounding: a larger gap is a kernel bug.

`backend="emulate"` on `Fp8Linear` / `Fp8MoEExperts` runs this instead of the kernels, on any
device and in any model dtype (tests/kernels/test_fp8_emulation.py, bench/fp8_accuracy.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moeserve.kernels.fp8_format import FP8, FP8_MAX, Block
from moeserve.layers.fp8_paths import uses_w8a16_gemv

F64 = torch.float64


def quantize_activations(x: torch.Tensor, group: int) -> torch.Tensor:
    """x [T, K] → the values the kernels multiply, float64 [T, K]: per row and group of `group`
    channels scale = max(amax, 1e-10) / 448 (float32), value = e4m3(x / scale) * scale."""
    t, k = x.shape
    groups = -(-k // group)
    xf = F.pad(x.float(), (0, groups * group - k)).view(t, groups, group)
    scale = xf.abs().amax(-1, keepdim=True).clamp(min=1e-10) / FP8_MAX  # float32, as the kernel
    q = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return (q.to(F64) * scale.to(F64)).view(t, groups * group)[:, :k]


def dequantize_weight(w: torch.Tensor, w_scale: torch.Tensor, block: Block) -> torch.Tensor:
    """w [N, K] e4m3 with w_scale [ceil(N/bn), ceil(K/bk)] → float64 [N, K] (partial edge blocks
    take their block's scale)."""
    n, k = w.shape
    bn, bk = block
    rows = torch.arange(n, device=w.device) // bn
    cols = torch.arange(k, device=w.device) // bk
    return w.to(F64) * w_scale.to(F64)[rows][:, cols]


def linear_quantizes(m: int, n: int, k: int, dtype: torch.dtype) -> bool:
    """Whether `fp8_linear` quantizes the activations of an [m, k] x [n, k]^T call: every path
    but the W8A16 GEMV does (layers/fp8_linear.py `fp8_gemm_path`)."""
    return not uses_w8a16_gemv(m, n, k, dtype)


def emulate_fp8_matmul(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, block: Block,
                       quantize: bool) -> torch.Tensor:
    """x [T, K] @ dequant(w)^T in float64 ([T, N]), x quantized first when `quantize`."""
    xa = quantize_activations(x, block[1]) if quantize else x.to(F64)
    return xa @ dequantize_weight(w, w_scale, block).t()


def emulate_fp8_linear(module, x: torch.Tensor) -> torch.Tensor:
    """`Fp8Linear` / `Fp8MergedLinear` forward as the Triton path computes it: [..., K] →
    [..., N] in x.dtype. A merged linear whose shards are not block-aligned runs one GEMM per
    shard, each choosing its path by its own N (as its forward does)."""
    x2 = x.reshape(-1, x.shape[-1])
    m, k = x2.shape
    shards = getattr(module, "shards", None)
    if shards is None or module.aligned:
        parts = [(module.weight, module.weight_scale_inv, module.out_features)]
    else:
        parts = [(w, s, w.shape[0]) for w, s in module._shard_views()]
    out = torch.cat([emulate_fp8_matmul(x2, w, s, module.block,
                                        linear_quantizes(m, n, k, x.dtype))
                     for w, s, n in parts], dim=1)
    if module.bias is not None:
        out = out + module.bias.to(F64)
    return out.to(x.dtype).view(*x.shape[:-1], module.out_features)


def emulate_fp8_moe(module, x: torch.Tensor, topk_ids: torch.Tensor,
                    topk_weights: torch.Tensor) -> torch.Tensor:
    """`Fp8MoEExperts` forward as `fused_moe` computes it: [T, H] in x.dtype. Up to
    SMALL_MAX_PAIRS pairs (fused_moe_small): x and the intermediate stay in x.dtype and the
    weighted top-k sum is one float32 reduction; beyond: x and the intermediate are quantized,
    each pair's weighted down output is stored in x.dtype, then summed."""
    from moeserve.kernels.triton.fused_moe_small import SMALL_MAX_PAIRS

    t, kk = topk_ids.shape
    small = t * kk <= SMALL_MAX_PAIRS
    i, g = module.intermediate_size, module.gate_scale_rows
    block = module.block
    xa = x.to(F64) if small else quantize_activations(x, block[1])
    out = torch.zeros(t, x.shape[1], dtype=F64, device=x.device)
    local = topk_ids - module.first_expert
    for e in range(module.num_local):
        tok, j = (local == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        w13, s13 = module.w13[e], module.w13_scale_inv[e]
        gate = xa[tok] @ dequantize_weight(w13[:i], s13[:g], block).t()
        up = xa[tok] @ dequantize_weight(w13[i:], s13[g:], block).t()
        inter = (F.silu(gate) * up).to(x.dtype)  # stored in x.dtype by the gate/up kernel
        inter = inter.to(F64) if small else quantize_activations(inter, block[1])
        down = inter @ dequantize_weight(module.w2[e], module.w2_scale_inv[e], block).t()
        down = down * topk_weights[tok, j].float().to(F64)[:, None]
        if not small:
            down = down.to(x.dtype).to(F64)  # each pair's row of y, in x.dtype
        out.index_add_(0, tok, down)
    return out.to(x.dtype)
