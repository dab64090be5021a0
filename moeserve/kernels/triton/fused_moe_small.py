"""Fused MoE for a few token pairs (decode): two GEMV launches, no sorting, no top-k sum pass.

    x [T, H] ──(pair, n-block): its expert's gate/up rows, silu(gate) * up──▶ inter [T*K, I]
    inter ──(token, n-block): its K experts' w2 rows, × routing weight, summed──▶ out [T, H]

Why: at batch-1 decode the sorted path (fused_moe.py) runs an align kernel, two grouped GEMMs
whose 16-row tiles each hold one real pair, and the top-k sum kernel. With M = 1 per pair there
is nothing to share between rows, so each program streams its expert's weight rows as a GEMV
(16-byte loads along the contiguous K, float32 FMAs, no tl.dot) and the top-k sum happens in the
down kernel's registers. A pair whose expert is not local (expert parallelism) launches a program
that returns at once; its inter row is never written, and the down kernel masks it out.

Each weight byte of a touched expert is read once per pair that chose it: pairs of one expert
are adjacent programs (the pair is the fastest grid axis), so repeats mostly hit L2. That repeat
is also why the path stops at SMALL_MAX_PAIRS (fused_moe picks it). Graph-safe: two launches
sized from T, K, H and I, no host sync.

FP8 experts (weight-only, W8A16): e4m3 w13/w2 with DeepSeek's block scales, x and inter kept in
x.dtype (the sorted path quantizes both). Why: at decode the sorted FP8 path adds two
quantization launches to the align / GEMM / sum ones, while here the weight bytes halve and the
launches stay two. A program's rows share one scale row (block_n divides bn) and a K step never
crosses a scale column (block_k <= bk), so each step's scale is one number per expert, folded into
the activation slice (no per-column gather); the steps' rows grow instead (block_n up to bn) to
keep the bytes in flight of the 16-bit path.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from moeserve.kernels.fp8_format import FP8, Block, scale_shape
from moeserve.kernels.triton.gemv import (FP8_TILE_ELEMS, MIN_BLOCK_K, TILE_ELEMS, GemvConfig,
                                          block_k_for, block_n_for, interpreter_block)
from moeserve.kernels.triton.pdl import launch_kwargs, pdl_wait

# T*K up to this: the GEMV path (fused_moe's auto choice), decode at batch <= 4 for K = 8. H200,
# bf16, CUDA graph, L2 flushed (bench.moe_kernels), Qwen3-30B-A3B experts, GEMV vs sorted µs:
# T=1 34.0 vs 38.5, T=2 60.1 vs 67.6, T=4 94.5 vs 101.2, T=8 157.2 vs 151.9 (0.97x). Beyond it
# pairs share experts more often (E = 128, 32 pairs: ~12% repeat one), which the GEMV reads again
# per pair while the sorted GEMM reads it once per 16 rows. FP8 experts take the same bound (not
# measured apart: their sorted path adds two quantization launches, which favours the GEMV).
SMALL_MAX_PAIRS = 32
# The down kernel: each step loads [next_pow2(K), block_n, block_k] of w2, 16K elements, over at
# least DOWN_PROGRAMS programs (two per SM: each streams K experts' rows). DeepSeek-V2-Lite at
# T=1 (I=1408): 8K-element steps over 512 programs took 52.6 µs in all, 16K over 256 44.5 (the
# sorted path 47.6); Qwen3-30B-A3B's T=1 was within 1 µs of 34 for either.
DOWN_TILE_ELEMS = 4 * TILE_ELEMS
DOWN_PROGRAMS = 256


class SmallMoeConfig(NamedTuple):
    gate_up: GemvConfig
    down: GemvConfig


def small_moe_config(t: int, k: int, h: int, i: int, device: torch.device,
                     fp8_block: Block | None = None) -> SmallMoeConfig:
    """gate_up: grid (T*K, I / block_n) of gate + up tiles; down: grid (T, H / block_n), each step
    a [next_pow2(K), block_n, block_k] tile. gate_up aims at TARGET_PROGRAMS programs (gemv.py),
    down at DOWN_PROGRAMS; not on CUDA, the fewest programs (`interpreter_block`). `fp8_block`
    (bn, bk) of e4m3 experts: block_n at most bn, block_k at most bk, steps of the 16-bit path's
    bytes (gate_up: FP8_TILE_ELEMS)."""
    bn = 64 if fp8_block is None else min(64, fp8_block[0])
    bk = 1 << 30 if fp8_block is None else fp8_block[1]
    if device.type != "cuda":
        return SmallMoeConfig(
            GemvConfig(interpreter_block(i, bn), min(bk, interpreter_block(h, 1024))),
            GemvConfig(interpreter_block(h, bn), min(bk, interpreter_block(i, 1024))))
    top = triton.next_power_of_2(k)
    if fp8_block is None:
        gu_n = block_n_for(i, t * k, 16)
        most = max(1, min(8, DOWN_TILE_ELEMS // (top * MIN_BLOCK_K)))
        dn_n = block_n_for(h, t, most, DOWN_PROGRAMS)
        return SmallMoeConfig(GemvConfig(gu_n, block_k_for(h, 2 * gu_n, TILE_ELEMS)),
                              GemvConfig(dn_n, block_k_for(i, top * dn_n, DOWN_TILE_ELEMS)))
    gu_k = min(bk, triton.next_power_of_2(h))
    gu_n = block_n_for(i, t * k, max(1, min(bn, FP8_TILE_ELEMS // (2 * gu_k))))
    dn_k = min(bk, triton.next_power_of_2(i))  # rows capped at 8 as in bf16: DeepSeek-V3, T=1,
    # 8 x 128 over 896 programs vs 16 x 128 over 448: 122.9-123.2 µs vs 128.3-128.5 (whole call).
    # 4 x 128 on 2 warps led a later sweep (123.9 µs) but one_batch did not move (batch 1:
    # 495.1 vs 495.0 tok/s, same call): these steps are not what bounds the down kernel
    dn_n = block_n_for(h, t, max(1, min(8, bn, DOWN_TILE_ELEMS // (top * dn_k))), DOWN_PROGRAMS)
    return SmallMoeConfig(GemvConfig(gu_n, gu_k), GemvConfig(dn_n, dn_k))


def fused_moe_small(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                    topk_weights: torch.Tensor, first_expert: int, num_local: int,
                    config: SmallMoeConfig | None = None, w13_scale: torch.Tensor | None = None,
                    w2_scale: torch.Tensor | None = None,
                    block: Block = (128, 128), pdl: bool = False) -> torch.Tensor:
    """`fused_moe`'s result (same arguments) by the two GEMV kernels: out [T, H] in x.dtype,
    inter rows rounded to x.dtype as the bf16 sorted path rounds them. FP8 experts (w13_scale
    and w2_scale in fused_moe's layout): weight-only, x and inter are not quantized. `pdl`:
    programmatic dependent launches (pdl.py; the expert ids come from the previous
    kernel, so nothing loads before the wait)."""
    t, h = x.shape
    inter_size, k = w13.shape[1] // 2, topk_ids.shape[1]
    assert w13.stride(2) == 1 and w2.stride(2) == 1 and w2.shape[1:] == (h, inter_size)
    fp8 = w13_scale is not None
    if fp8:
        _check_fp8(w13, w2, w13_scale, w2_scale, block)
    x = x if x.stride(1) == 1 else x.contiguous()
    ids = topk_ids.contiguous()
    weights = topk_weights.to(torch.float32).contiguous()
    cfg = config or small_moe_config(t, k, h, inter_size, x.device, block if fp8 else None)
    gu, dn = cfg
    if fp8 and (block[0] % gu.block_n or block[0] % dn.block_n or block[1] % gu.block_k
                or block[1] % dn.block_k):
        raise ValueError(f"fused_moe_small: block_n {gu.block_n}/{dn.block_n} and block_k "
                         f"{gu.block_k}/{dn.block_k} must divide the scale block {list(block)}")
    s13, s2 = (w13_scale, w2_scale) if fp8 else (x, x)
    s13_strides = (s13.stride(0), s13.stride(1)) if fp8 else (0, 0)
    s2_strides = (s2.stride(0), s2.stride(1)) if fp8 else (0, 0)
    inter = x.new_empty((t * k, inter_size))  # [T*K, I] by pair; non-local rows never written
    _gate_up_kernel[(t * k, triton.cdiv(inter_size, gu.block_n))](
        x, w13, s13, ids, inter, first_expert, num_local, h, inter_size, x.stride(0),
        w13.stride(0), w13.stride(1), *s13_strides, triton.cdiv(inter_size, block[0]),
        TOP_K=k, BLOCK_N=gu.block_n, BLOCK_K=gu.block_k, EVEN_K=h % gu.block_k == 0, FP8=fp8,
        SCALE_BN=block[0], SCALE_BK=block[1], num_warps=gu.num_warps, **launch_kwargs(pdl))
    out = x.new_empty((t, h))
    _down_kernel[(t, triton.cdiv(h, dn.block_n))](
        inter, w2, s2, ids, weights, out, first_expert, num_local, h, inter_size, w2.stride(0),
        w2.stride(1), *s2_strides, TOP_K=k, BLOCK_TOPK=triton.next_power_of_2(k),
        BLOCK_N=dn.block_n, BLOCK_K=dn.block_k, EVEN_K=inter_size % dn.block_k == 0, FP8=fp8,
        SCALE_BN=block[0], SCALE_BK=block[1], num_warps=dn.num_warps, **launch_kwargs(pdl))
    return out


def _check_fp8(w13, w2, w13_scale, w2_scale, block: Block) -> None:
    """e4m3 experts with fused_moe's scale layout (gate's block rows, then up's), unit
    column stride and float32."""
    e, two_i, h = w13.shape
    gate_rows, h_blocks = scale_shape(two_i // 2, h, block)
    want = {"w13_scale": (e, 2 * gate_rows, h_blocks),
            "w2_scale": (e, *scale_shape(h, two_i // 2, block))}
    for name, scale in (("w13_scale", w13_scale), ("w2_scale", w2_scale)):
        if scale is None or tuple(scale.shape) != want[name]:
            raise ValueError(f"fused_moe_small: {name} "
                             f"{None if scale is None else tuple(scale.shape)}, expected "
                             f"{want[name]} for blocks {list(block)}")
        assert scale.stride(2) == 1 and scale.dtype == torch.float32
    if w13.dtype != FP8 or w2.dtype != FP8:
        raise ValueError(f"fused_moe_small: scales given with {w13.dtype} / {w2.dtype} experts")


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, s_ptr, ids_ptr, inter_ptr, first_expert, num_local, hidden,
                    inter_size, stride_xm, stride_we, stride_wn, stride_se, stride_sn,
                    up_scale_rows, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, FP8: tl.constexpr,
                    SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr, USE_PDL: tl.constexpr):
    """Program (pair, n-block): inter[pair, n] = silu(x[t] . gate_e[n]) * (x[t] . up_e[n]).
    Products accumulate per lane in [BLOCK_N, BLOCK_K] float32 and are reduced once at the end
    (no cross-thread reduction inside the loop). FP8: s [E, 2 * up_scale_rows, K blocks], gate's
    scale rows then up's; the program's rows share one of each, a step one scale column."""
    pdl_wait(USE_PDL)
    pair = tl.program_id(0)
    local = tl.load(ids_ptr + pair) - first_expert
    if (local < 0) | (local >= num_local):
        return
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows = offs_n % inter_size  # rows past the end wrap to valid ones, never stored
    gate_ptrs = (w_ptr + local.to(tl.int64) * stride_we + rows[:, None] * stride_wn
                 + offs_k[None, :])  # [BN, BK]
    up_shift = inter_size * stride_wn
    x_ptrs = x_ptr + (pair // TOP_K).to(tl.int64) * stride_xm + offs_k
    if FP8:
        s_gate = (s_ptr + local.to(tl.int64) * stride_se
                  + (tl.program_id(1) * BLOCK_N // SCALE_BN) * stride_sn)
        s_up = s_gate + up_scale_rows * stride_sn
    acc_g = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        if EVEN_K:
            g = tl.load(gate_ptrs)
            u = tl.load(gate_ptrs + up_shift)
            xk = tl.load(x_ptrs)
        else:
            k_ok = offs_k < hidden - k0
            g = tl.load(gate_ptrs, mask=k_ok[None, :], other=0.0)
            u = tl.load(gate_ptrs + up_shift, mask=k_ok[None, :], other=0.0)
            xk = tl.load(x_ptrs, mask=k_ok, other=0.0)
        xk = xk.to(tl.float32)[None, :]
        if FP8:  # the step's block scale (BLOCK_K <= SCALE_BK), folded into x
            acc_g += g.to(tl.float32) * (xk * tl.load(s_gate + k0 // SCALE_BK))
            acc_u += u.to(tl.float32) * (xk * tl.load(s_up + k0 // SCALE_BK))
        else:
            acc_g += g.to(tl.float32) * xk
            acc_u += u.to(tl.float32) * xk
        gate_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    gate = tl.sum(acc_g, axis=1)
    act = gate * tl.sigmoid(gate) * tl.sum(acc_u, axis=1)  # [BN]
    out = inter_ptr + pair.to(tl.int64) * inter_size + offs_n
    tl.store(out, act.to(inter_ptr.dtype.element_ty), mask=offs_n < inter_size)


@triton.jit
def _down_kernel(inter_ptr, w_ptr, s_ptr, ids_ptr, weights_ptr, out_ptr, first_expert, num_local,
                 hidden, inter_size, stride_we, stride_wn, stride_se, stride_sn,
                 TOP_K: tl.constexpr, BLOCK_TOPK: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, FP8: tl.constexpr,
                 SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr, USE_PDL: tl.constexpr):
    """Program (token, n-block): out[t, n] = sum over t's local pairs of
    weight[t, k] * (inter[t*K + k] . w2_e[n]). The K pairs are one axis of each step's
    [BLOCK_TOPK, BLOCK_N, BLOCK_K] tile: every expert's rows are requested at once, and a
    non-local (or padding) pair's loads are masked off, so it reads nothing. FP8: s [E, H
    blocks, I blocks]; each pair's expert has one scale row for the program's rows and one
    scale column per step (BLOCK_K <= SCALE_BK)."""
    pdl_wait(USE_PDL)
    t = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_TOPK)
    pairs = t * TOP_K + kk  # [BT]
    local = tl.load(ids_ptr + pairs, mask=kk < TOP_K, other=0) - first_expert
    ok = (kk < TOP_K) & (local >= 0) & (local < num_local)
    wt = tl.load(weights_ptr + pairs, mask=ok, other=0.0)  # [BT] float32
    offs_k = tl.arange(0, BLOCK_K)
    rows = offs_n % hidden  # rows past the end wrap to valid ones, never stored
    w_ptrs = (w_ptr + tl.where(ok, local, 0).to(tl.int64)[:, None, None] * stride_we
              + rows[None, :, None] * stride_wn + offs_k[None, None, :])  # [BT, BN, BK]
    a_ptrs = inter_ptr + pairs.to(tl.int64)[:, None] * inter_size + offs_k[None, :]  # [BT, BK]
    if FP8:
        s_rows = (s_ptr + tl.where(ok, local, 0).to(tl.int64) * stride_se
                  + (tl.program_id(1) * BLOCK_N // SCALE_BN) * stride_sn)  # [BT]
    acc = tl.zeros([BLOCK_TOPK, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, inter_size, BLOCK_K):
        if EVEN_K:
            mask = ok[:, None]
        else:
            mask = ok[:, None] & (offs_k < inter_size - k0)[None, :]
        a = tl.load(a_ptrs, mask=mask, other=0.0).to(tl.float32)
        if FP8:  # [BT]: each pair's block scale of this step, folded into its inter row
            a *= tl.load(s_rows + k0 // SCALE_BK, mask=ok, other=0.0)[:, None]
        w = tl.load(w_ptrs, mask=mask[:, None, :], other=0.0).to(tl.float32)
        acc += w * a[:, None, :]
        w_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
    y = tl.sum(tl.sum(acc, axis=2) * wt[:, None], axis=0)  # [BN]
    out = out_ptr + t.to(tl.int64) * hidden + offs_n
    tl.store(out, y.to(out_ptr.dtype.element_ty), mask=offs_n < hidden)
