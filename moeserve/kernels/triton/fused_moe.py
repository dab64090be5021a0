"""Fused MoE for routed experts: token pairs sorted into expert blocks, then two grouped GEMMs.

    x [T, H] ──gather rows──▶ gate_up GEMM (+ silu(gate) * up) ──▶ inter [T*K, I]     (by pair id)
    inter ──down GEMM (× routing weight)──▶ y [T*K, H] ──sum over K (local pairs)──▶ out [T, H]

A pair p = t * K + k is token t's k-th choice. `moe_align_block_size` (moe_align.py) lays the
local pairs out expert by expert, each expert padded to whole blocks of BLOCK_SIZE_M rows, so
every m-block of the GEMMs reads one expert's weights. A config's `SWAP_AB` computes the tiles
transposed (weights x tokens), so small token blocks pad less while the MMA stays wide
(docs/gpu_decode.md, "Swap-AB tiles"). Everything is sized from T*K, E_local and BLOCK_SIZE_M and
never waits on the host, so the whole call can be captured in a CUDA graph.

Up to SMALL_MAX_PAIRS pairs (decode), `fused_moe` runs two GEMV kernels instead:
fused_moe_small.py, no align step and no sum pass (FP8 experts there: weight-only, the
activations stay in x.dtype).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeserve.kernels.triton import fp8 as fp8_kernels
from moeserve.kernels.triton.fp8 import fp8_dot
from moeserve.kernels.triton.fused_moe_small import SMALL_MAX_PAIRS, fused_moe_small
from moeserve.kernels.triton.moe_align import moe_align_block_size
from moeserve.kernels.triton.moe_config import b_tma, down_config, get_moe_config, swap_ab
from moeserve.kernels.triton.pdl import launch_kwargs, pdl_wait
from moeserve.kernels.triton.tma import TensorDescriptor, tma_ok


@triton.jit
def _mma(a, b, acc, a_s, b_s, FP8: tl.constexpr, SWAP_AB: tl.constexpr, EXACT_DOT: tl.constexpr):
    """acc + the tile product of activations a [BM, BK] and weights b: [BK, BN] into acc [BM, BN],
    or under SWAP_AB [BN, BK] into acc [BN, BM] (b @ a^T). FP8: scaled by the activation rows'
    a_s [BM] and the weight rows' b_s [BN] (both ignored otherwise)."""
    if SWAP_AB:
        if FP8:
            acc += fp8_dot(b, tl.trans(a), EXACT_DOT) * b_s[:, None] * a_s[None, :]
        else:
            acc = tl.dot(b, tl.trans(a), acc=acc)
    else:
        if FP8:
            acc += fp8_dot(a, b, EXACT_DOT) * a_s[:, None] * b_s[None, :]
        else:
            acc = tl.dot(a, b, acc=acc)
    return acc


@triton.jit
def _tma_tile(b_desc, row, k0, SWAP_AB: tl.constexpr):
    """A weight tile by TMA: [BN, BK] as stored, or [BK, BN] as the non-swapped MMA takes it."""
    b = b_desc.load([row, k0])
    if not SWAP_AB:
        b = b.T
    return b


@triton.jit(do_not_specialize=["num_pairs", "num_pid_m"])
def _moe_gemm_kernel(a_ptr, b_ptr, b_desc, c_ptr, weight_ptr, sorted_ptr, expert_ptr, num_post_ptr,
                     as_ptr, bs_ptr, N, K, num_pairs, num_pid_m, b_rows, stride_am, stride_ak,
                     stride_be, stride_bn, stride_bk, stride_cm, stride_cn, stride_asm,
                     stride_bse, stride_bsn, up_scale_rows, ROW_DIV: tl.constexpr,
                     GATED: tl.constexpr, WEIGHTED: tl.constexpr, EVEN_K: tl.constexpr,
                     FP8: tl.constexpr, SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr,
                     BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr,
                     BLOCK_SIZE_K: tl.constexpr, GROUP_SIZE_M: tl.constexpr,
                     SWAP_AB: tl.constexpr, B_TMA: tl.constexpr, EXACT_DOT: tl.constexpr,
                     USE_PDL: tl.constexpr):
    """c[pair, n] = a[pair // ROW_DIV] @ b[expert, n]^T for the pairs of one expert block.
    GATED: b holds [gate | up] rows (N each), c = silu(gate) * up. WEIGHTED: c *= weight[pair].
    FP8: a and b are e4m3; a row's scale per SCALE_BK channels is as[row, k // SCALE_BK] and b's
    per SCALE_BN x SCALE_BK block bs[expert, n // SCALE_BN, k // SCALE_BK] (BLOCK_SIZE_K divides
    SCALE_BK); gate and up are blocked separately, up's scale rows start at `up_scale_rows`.
    SWAP_AB: the tile is computed transposed, [BLOCK_SIZE_N, BLOCK_SIZE_M] = w_tile @ x_tile^T, so
    the weight rows fill the MMA's M side and a small token block (less padding per expert) its
    N side; gating, scales, routing weights (per column) and the store follow that layout.
    B_TMA: the weight tiles come through `b_desc`, a TMA descriptor over b as [E * b_rows, K]
    (tma.py); rows past an expert's N are computed and never stored, columns past K arrive as
    zeros. The launch keeps pointer loads where the descriptor does not apply (tma.tma_ok)."""
    pdl_wait(USE_PDL)
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_SIZE_N)
    in_group = GROUP_SIZE_M * num_pid_n  # GROUP_SIZE_M m-blocks share each B tile while in L2
    group_first = pid // in_group * GROUP_SIZE_M
    group_rows = min(num_pid_m - group_first, GROUP_SIZE_M)
    pid_m = group_first + (pid % in_group) % group_rows
    pid_n = (pid % in_group) // group_rows
    if pid_m * BLOCK_SIZE_M >= tl.load(num_post_ptr):
        return
    expert = tl.load(expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    pair = tl.load(sorted_ptr + pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M))  # [BM]
    row_ok = pair < num_pairs
    offs_n = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    offs_bn = offs_n % N  # wrapped columns stay in bounds; their results are never stored
    offs_k = tl.arange(0, BLOCK_SIZE_K)
    a_ptrs = (a_ptr + (pair // ROW_DIV).to(tl.int64)[:, None] * stride_am
              + offs_k[None, :] * stride_ak)  # [BM, BK]
    if SWAP_AB:  # [BN, BK]: K-contiguous rows, the MMA's A operand
        b_ptrs = (b_ptr + expert * stride_be + offs_bn[:, None] * stride_bn
                  + offs_k[None, :] * stride_bk)
        acc = tl.zeros((BLOCK_SIZE_N, BLOCK_SIZE_M), dtype=tl.float32)
    else:  # [BK, BN]; one expert's offsets fit in int32
        b_ptrs = (b_ptr + expert * stride_be + offs_bn[None, :] * stride_bn
                  + offs_k[:, None] * stride_bk)
        acc = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    acc_up = tl.zeros_like(acc)
    up_shift = N * stride_bn
    row0 = (expert * b_rows + pid_n * BLOCK_SIZE_N).to(tl.int32)  # B_TMA: the tile's first row
    for k0 in range(0, K, BLOCK_SIZE_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
        else:
            k_ok = offs_k < K - k0
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            if SWAP_AB:
                kb_ok = k_ok[None, :]
            else:
                kb_ok = k_ok[:, None]
        if B_TMA:
            b = _tma_tile(b_desc, row0, k0, SWAP_AB)
        elif EVEN_K:
            b = tl.load(b_ptrs)
        else:
            b = tl.load(b_ptrs, mask=kb_ok, other=0.0)
        if FP8:
            g = k0 // SCALE_BK
            a_s = tl.load(as_ptr + (pair // ROW_DIV).to(tl.int64) * stride_asm + g, mask=row_ok,
                          other=0.0)  # [BM]
            b_s = tl.load(bs_ptr + expert * stride_bse + (offs_bn // SCALE_BN) * stride_bsn + g)
        else:  # unused
            a_s = 0.0
            b_s = 0.0
        acc = _mma(a, b, acc, a_s, b_s, FP8, SWAP_AB, EXACT_DOT)
        if GATED:
            if B_TMA:
                b_up = _tma_tile(b_desc, row0 + N, k0, SWAP_AB)
            elif EVEN_K:
                b_up = tl.load(b_ptrs + up_shift)
            else:
                b_up = tl.load(b_ptrs + up_shift, mask=kb_ok, other=0.0)
            if FP8:
                b_s_up = tl.load(bs_ptr + expert * stride_bse
                                 + (up_scale_rows + offs_bn // SCALE_BN) * stride_bsn + g)
            else:
                b_s_up = 0.0
            acc_up = _mma(a, b_up, acc_up, a_s, b_s_up, FP8, SWAP_AB, EXACT_DOT)
        a_ptrs += BLOCK_SIZE_K * stride_ak
        b_ptrs += BLOCK_SIZE_K * stride_bk
    if GATED:
        acc = acc * tl.sigmoid(acc) * acc_up
    rows = pair.to(tl.int64)
    if SWAP_AB:  # columns are pairs
        if WEIGHTED:
            acc = acc * tl.load(weight_ptr + pair, mask=row_ok, other=0.0)[None, :]
        c_ptrs = c_ptr + rows[None, :] * stride_cm + offs_n[:, None] * stride_cn  # [BN, BM]
        c_mask = row_ok[None, :] & (offs_n < N)[:, None]
    else:
        if WEIGHTED:
            acc = acc * tl.load(weight_ptr + pair, mask=row_ok, other=0.0)[:, None]
        c_ptrs = c_ptr + rows[:, None] * stride_cm + offs_n[None, :] * stride_cn  # [BM, BN]
        c_mask = row_ok[:, None] & (offs_n < N)[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


@triton.jit
def _sum_local_pairs_kernel(y_ptr, ids_ptr, out_ptr, first_expert, num_local, H,
                            TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr,
                            USE_PDL: tl.constexpr):
    """out[t] = sum_k y[t*K + k] over local pairs: other rows were never written (masked load).
    The K rows load as one [BLOCK_K, BLOCK_H] tile: a branch per pair made K dependent round
    trips (~10 µs a layer at 256 tokens, 5x its bytes)."""
    pdl_wait(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs < H
    kk = tl.arange(0, BLOCK_K)
    local = tl.load(ids_ptr + t * TOP_K + kk, mask=kk < TOP_K, other=-1) - first_expert
    k_ok = (kk < TOP_K) & (local >= 0) & (local < num_local)
    rows = y_ptr + (t * TOP_K + kk)[:, None] * H + offs[None, :]
    y = tl.load(rows, mask=k_ok[:, None] & h_ok[None, :], other=0.0).to(tl.float32)
    tl.store(out_ptr + t * H + offs, tl.sum(y, axis=0).to(out_ptr.dtype.element_ty), mask=h_ok)


def _grouped_gemm(a, b, c, weights, sorted_ids, expert_ids, num_post, row_div, gated, cfg,
                  a_scale=None, b_scale=None, block=(128, 128), pdl=False):
    """c [T*K, N] by pair id ← a rows (pair // row_div) @ b[expert]^T; b [E, N or 2N, Kdim].
    With a_scale [rows, Kdim/bk] and b_scale [E, scale rows, Kdim/bk]: FP8 operands in (bn, bk)
    blocks; gated b's scale rows are gate's ceil(N/bn) then up's."""
    n = c.shape[1]
    kdim = a.shape[1]
    bm, bn, bk = cfg["BLOCK_SIZE_M"], cfg["BLOCK_SIZE_N"], cfg["BLOCK_SIZE_K"]
    swap = swap_ab(cfg)
    fp8 = b_scale is not None
    if fp8:
        bk = min(bk, block[1])  # a K tile must stay inside one scale group
        assert b_scale.stride(2) == 1 and a_scale.stride(1) == 1
    num_pid_m = sorted_ids.shape[0] // bm
    grid = (num_pid_m * triton.cdiv(n, bn),)
    scales = (a_scale, b_scale) if fp8 else (c, c)
    b_desc = None
    if b_tma(cfg) and b.is_contiguous():
        b_2d = b.view(-1, b.shape[2])  # [E * rows, K]: one descriptor over every expert
        if tma_ok(b_2d, interpreted=True):
            b_desc = TensorDescriptor.from_tensor(b_2d, [bn, bk])
    _moe_gemm_kernel[grid](
        a, b, b_desc, c, weights if weights is not None else c, sorted_ids, expert_ids, num_post,
        *scales, n, kdim, c.shape[0], num_pid_m, b.shape[1], a.stride(0), a.stride(1),
        b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1),
        a_scale.stride(0) if fp8 else 0, b_scale.stride(0) if fp8 else 0,
        b_scale.stride(1) if fp8 else 0, triton.cdiv(n, block[0]), ROW_DIV=row_div, GATED=gated,
        WEIGHTED=weights is not None, EVEN_K=kdim % bk == 0, FP8=fp8, SCALE_BN=block[0],
        SCALE_BK=block[1], BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk,
        GROUP_SIZE_M=cfg["GROUP_SIZE_M"], SWAP_AB=swap, B_TMA=b_desc is not None,
        EXACT_DOT=fp8 and fp8_kernels.EXACT_DOT, num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"], **launch_kwargs(pdl))


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
              topk_weights: torch.Tensor, first_expert: int = 0, num_local: int | None = None,
              config: dict | None = None, w13_scale: torch.Tensor | None = None,
              w2_scale: torch.Tensor | None = None, block: tuple[int, int] = (128, 128),
              small_path: bool | None = None, pdl: bool = False) -> torch.Tensor:
    """sum_k w[t,k] * (silu(x[t] @ gate_e^T) * (x[t] @ up_e^T)) @ w2_e^T over the pairs whose
    e = ids[t,k] - first_expert is in [0, num_local): [T, H] in x.dtype (fp32 accumulation).

    x [T, H]; w13 [E_local, 2I, H] as [gate | up]; w2 [E_local, H, I]; topk_ids [T, K] global ids;
    topk_weights [T, K]. `config`: launch config (default: `get_moe_config` for this shape; its
    optional `down` entry retiles the down GEMM; `SWAP_AB` 1 computes a GEMM's tiles transposed,
    _moe_gemm_kernel).
    FP8 experts: w13/w2 float8_e4m3fn with (bn, bk) = `block` scales w13_scale
    [E, 2 * ceil(I/bn), ceil(H/bk)] (gate and up blocked separately, as checkpoints store them) and
    w2_scale [E, ceil(H/bn), ceil(I/bk)]; the sorted path quantizes activations per token and bk
    channels, the small one does not (W8A16).
    `small_path`: the GEMV kernels of fused_moe_small (True) or the sorted grouped GEMMs
    (False); None picks GEMV for T*K <= SMALL_MAX_PAIRS pairs. `config` is the sorted path's.
    `pdl`: programmatic dependent launches (pdl.py)."""
    t, h = x.shape
    e_local, two_i, _ = w13.shape
    inter_size, k = two_i // 2, topk_ids.shape[1]
    num_local = e_local if num_local is None else num_local
    if num_local > e_local:
        raise ValueError(f"num_local={num_local} but w13 holds {e_local} experts")
    if t == 0:
        return x.new_empty((0, h))
    if small_path is None:
        small_path = t * k <= SMALL_MAX_PAIRS
    if small_path:
        return fused_moe_small(x, w13, w2, topk_ids, topk_weights, first_expert, num_local,
                               w13_scale=w13_scale, w2_scale=w2_scale, block=tuple(block),
                               pdl=pdl)
    cfg = config or get_moe_config(e_local, h, inter_size, k, x.dtype, t)
    ids = topk_ids.contiguous()
    sorted_ids, expert_ids, num_post = moe_align_block_size(ids, cfg["BLOCK_SIZE_M"],
                                                            first_expert, num_local, pdl)
    inter = x.new_empty((t * k, inter_size))  # [T*K, I] by pair; non-local rows never written
    weights = topk_weights.to(torch.float32).contiguous().view(-1)
    y = x.new_empty((t * k, h))  # [T*K, H] weighted by pair
    if w13_scale is None:
        _grouped_gemm(x, w13, inter, None, sorted_ids, expert_ids, num_post, k, True, cfg,
                      pdl=pdl)
        _grouped_gemm(inter, w2, y, weights, sorted_ids, expert_ids, num_post, 1, False,
                      down_config(cfg), pdl=pdl)
    else:
        from moeserve.kernels.triton.fp8 import quant_fp8_per_token_group

        x_q, x_s = quant_fp8_per_token_group(x, block[1])
        _grouped_gemm(x_q, w13, inter, None, sorted_ids, expert_ids, num_post, k, True, cfg,
                      x_s, w13_scale, block)
        # NOTE: rows of non-local pairs hold garbage; their scales too, and nothing reads them
        i_q, i_s = quant_fp8_per_token_group(inter, block[1])
        _grouped_gemm(i_q, w2, y, weights, sorted_ids, expert_ids, num_post, 1, False,
                      down_config(cfg), i_s, w2_scale, block)
    return sum_local_pairs(y, ids, x.new_empty((t, h)), first_expert, num_local, pdl)


def sum_local_pairs(y: torch.Tensor, ids: torch.Tensor, out: torch.Tensor, first_expert: int,
                    num_local: int, pdl: bool = False) -> torch.Tensor:
    """out [T, H] ← the sum of each token's K pair rows of y [T*K, H] (the down GEMM weighted
    them) over the pairs whose expert is local."""
    t, k = ids.shape
    h = y.shape[1]
    block_k = max(2, triton.next_power_of_2(k))
    # >= 1024 columns: 16-byte loads per thread at 4 warps (512 ran at 1.7 TB/s, 1024 at 2.8 on
    # an H100, Qwen3's 4096 x 8 pairs; docs/gpu_decode.md)
    block_h = min(max(1024, 8192 // block_k), triton.next_power_of_2(h))
    _sum_local_pairs_kernel[(t, triton.cdiv(h, block_h))](y, ids, out, first_expert, num_local,
                                                          h, TOP_K=k, BLOCK_K=block_k,
                                                          BLOCK_H=block_h, **launch_kwargs(pdl))
    return out
