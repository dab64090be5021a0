"""Per-head GEMV for one token: out[0, h] = x[0, h] @ W[h] for every head h in one launch, with
W either [H, K, N] (N contiguous) or [H, N, K] (K contiguous).

Why: MLA's absorbed projections at decode (q_nope @ W_UK into the latent, the attention output
@ W_UV^T out of it) ran as cuBLAS batched GEMMs of one row per head: 6.5-6.7 µs each for 16.8 MB
on a DeepSeek-V3 layer (2.5 TB/s, H200 profile), and, not being PDL launches, the kernel after
them waited for the grid to drain. Here each program streams one [K, N] tile column of one head
in 16 KB tiles, fp32 accumulation, the first tile loaded before the PDL wait.

FP8 (`w_scale`): W an e4m3 view of kv_b_proj [H * (nope + v), R] with DeepSeek's block scales.
Each head's rows start on a scale-block row (nope and nope + v multiples of bn, as DeepSeek-V3's
128 are), and a tile never crosses a block row, so one K step needs one scale row: along N (a
scale per output column block, applied to the step's sums) where W is [K, N], or along K
(folded into x) where it is [N, K]. Shapes that do not align return None (the caller's einsum
runs on the dequantized weight).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeserve.kernels.fp8_format import Block
from moeserve.kernels.triton.pdl import launch_kwargs, pdl_wait

TILE_ELEMS = 8192  # weight elements a program holds per step (16 KB of bf16)
FP8_TILE_ELEMS = 2 * TILE_ELEMS  # the same 16 KB in e4m3


def head_gemv(x: torch.Tensor, w: torch.Tensor, k_major: bool, pdl: bool = False,
              w_scale: torch.Tensor | None = None, block: Block | None = None
              ) -> torch.Tensor | None:
    """x [1, H, K] (unit last stride) → [1, H, N] in x.dtype. k_major: w is [H, K, N] (x @ w[h]),
    else [H, N, K] (x @ w[h]^T); unit last stride either way. `w_scale` [rows / bn, cols / bk]
    with `block` (bn, bk): w is an e4m3 view of the [rows, cols] matrix those scales cover, rows
    per head w.stride(0) / w.stride(1) (module docstring); None where its heads do not align."""
    _, h, k = x.shape
    n = w.shape[2] if k_major else w.shape[1]
    assert x.shape[0] == 1 and x.stride(2) == 1 and w.stride(2) == 1 and w.shape[0] == h
    assert (w.shape[1] if k_major else w.shape[2]) == k
    tile = TILE_ELEMS if w_scale is None else FP8_TILE_ELEMS
    bn, bk = block or (1 << 30, 1 << 30)
    if k_major:  # tile [BLOCK_K, BLOCK_N], N along the fast axis
        block_n = min(64 if w_scale is None else 128, triton.next_power_of_2(n), bk)
        block_k = min(triton.next_power_of_2(k), max(16, tile // block_n), bn)
    else:  # tile [BLOCK_N, BLOCK_K], K along the fast axis
        block_k = min(triton.next_power_of_2(k), 512)
        block_n = min(triton.next_power_of_2(n), max(1, tile // block_k), bn)
    head_rows, first_row = w.stride(0) // w.stride(1), 0
    if w_scale is not None:
        first_row = (w.storage_offset() % w.stride(0)) // w.stride(1)  # W_UV: after W_UK's rows
        rows_step = block_k if k_major else block_n
        if (head_rows % bn or first_row % bn or bn % rows_step or w.stride(0) % w.stride(1)
                or w.shape[2] != w.stride(1)):  # whole rows of the scaled matrix
            return None
    out = torch.empty((1, h, n), dtype=x.dtype, device=x.device)
    _head_gemv_kernel[(h, triton.cdiv(n, block_n))](
        x, w, out, x.stride(1), w.stride(0), w.stride(1), n, k,
        w if w_scale is None else w_scale, 0 if w_scale is None else w_scale.stride(0),
        head_rows, first_row, K_MAJOR=k_major, BLOCK_N=block_n, BLOCK_K=block_k,
        HAS_SCALE=w_scale is not None, SBN=bn, SBK=bk, num_warps=4, **launch_kwargs(pdl))
    return out


@triton.jit
def _w_tile(w_head, offs_n, offs_k, stride_w1, n, k, K_MAJOR: tl.constexpr):
    """The [BLOCK_N, BLOCK_K] tile of head w_head's W (zero outside N x K), float32."""
    mask = (offs_n < n)[:, None] & (offs_k < k)[None, :]
    if K_MAJOR:  # w[h] [K, N]: element (k, n) at k * stride_w1 + n
        ptrs = w_head + offs_k[None, :].to(tl.int64) * stride_w1 + offs_n[:, None]
    else:  # w[h] [N, K]: element (n, k) at n * stride_w1 + k
        ptrs = w_head + offs_n[:, None].to(tl.int64) * stride_w1 + offs_k[None, :]
    return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _head_step(tile, x_head, k0, offs_n, offs_k, n, k, s_ptr, stride_s0, row0,
               K_MAJOR: tl.constexpr, HAS_SCALE: tl.constexpr, SBN: tl.constexpr,
               SBK: tl.constexpr):
    """One K step's sums [BLOCK_N] of the tile (float32) with x[k0 + offs_k]; with scales, the
    step's scale row: along N (K_MAJOR: the rows of W are K) or folded into x. row0: the global
    W row of this head's first row (and of this program's first N row unless K_MAJOR)."""
    xv = tl.load(x_head + k0 + offs_k, mask=k0 + offs_k < k, other=0.0).to(tl.float32)
    if HAS_SCALE and K_MAJOR:
        s = tl.load(s_ptr + ((row0 + k0) // SBN) * stride_s0 + offs_n // SBK, mask=offs_n < n,
                    other=0.0)
        return tl.sum(tile * xv[None, :], axis=1) * s
    if HAS_SCALE:
        xv *= tl.load(s_ptr + (row0 // SBN) * stride_s0 + (k0 + offs_k) // SBK,
                      mask=k0 + offs_k < k, other=0.0)
    return tl.sum(tile * xv[None, :], axis=1)


@triton.jit
def _head_gemv_kernel(x, w, out, stride_xh, stride_w0, stride_w1, n, k, s_ptr, stride_s0,
                      head_rows, first_row, K_MAJOR: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, HAS_SCALE: tl.constexpr, SBN: tl.constexpr,
                      SBK: tl.constexpr, USE_PDL: tl.constexpr):
    """Program (head, n block): out[0, head, n block] = sum over K steps of W tile . x slice."""
    head = tl.program_id(0).to(tl.int64)
    n0 = tl.program_id(1) * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    w_head = w + head * stride_w0
    x_head = x + head * stride_xh
    row0 = head * head_rows + first_row + (0 if K_MAJOR else n0)
    tile = _w_tile(w_head, offs_n, offs_k, stride_w1, n, k, K_MAJOR)
    pdl_wait(USE_PDL)
    acc = _head_step(tile, x_head, 0, offs_n, offs_k, n, k, s_ptr, stride_s0, row0, K_MAJOR,
                     HAS_SCALE, SBN, SBK)  # [BLOCK_N]
    for k0 in range(BLOCK_K, k, BLOCK_K):
        tile = _w_tile(w_head, offs_n, k0 + offs_k, stride_w1, n, k, K_MAJOR)
        acc += _head_step(tile, x_head, k0, offs_n, offs_k, n, k, s_ptr, stride_s0, row0,
                          K_MAJOR, HAS_SCALE, SBN, SBK)
    tl.store(out + head * n + offs_n, acc.to(out.dtype.element_ty), mask=offs_n < n)
