"""Per-head GEMV for one token: out[0, h] = x[0, h] @ W[h] for every head h in one launch, with
W either [H, K, N] (N contiguous) or [H, N, K] (K contiguous).

Why: MLA's absorbed projections at decode (q_nope @ W_UK into the latent, the attention output
@ W_UV^T out of it) ran as cuBLAS batched GEMMs of one row per head: 6.5-6.7 µs each for 16.8 MB
on a DeepSeek-V3 layer (2.5 TB/s, H200 profile), and, not being PDL launches, the kernel after
them waited for the grid to drain. Here each program streams one [K, N] tile column of one head
in 16 KB tiles, fp32 accumulation, the first tile loaded before the PDL wait.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeserve.kernels.pdl import launch_kwargs, pdl_wait

TILE_ELEMS = 8192  # weight elements a program holds per step (16 KB of bf16)


def head_gemv(x: torch.Tensor, w: torch.Tensor, k_major: bool, pdl: bool = False) -> torch.Tensor:
    """x [1, H, K] (unit last stride) → [1, H, N] in x.dtype. k_major: w is [H, K, N] (x @ w[h]),
    else [H, N, K] (x @ w[h]^T); unit last stride either way."""
    _, h, k = x.shape
    n = w.shape[2] if k_major else w.shape[1]
    assert x.shape[0] == 1 and x.stride(2) == 1 and w.stride(2) == 1 and w.shape[0] == h
    assert (w.shape[1] if k_major else w.shape[2]) == k
    out = torch.empty((1, h, n), dtype=x.dtype, device=x.device)
    if k_major:  # tile [BLOCK_K, BLOCK_N], N along the fast axis
        block_n = min(64, triton.next_power_of_2(n))
        block_k = min(triton.next_power_of_2(k), max(16, TILE_ELEMS // block_n))
    else:  # tile [BLOCK_N, BLOCK_K], K along the fast axis
        block_k = min(triton.next_power_of_2(k), 512)
        block_n = min(triton.next_power_of_2(n), max(1, TILE_ELEMS // block_k))
    _head_gemv_kernel[(h, triton.cdiv(n, block_n))](
        x, w, out, x.stride(1), w.stride(0), w.stride(1), n, k, K_MAJOR=k_major,
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, **launch_kwargs(pdl))
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
def _head_gemv_kernel(x, w, out, stride_xh, stride_w0, stride_w1, n, k, K_MAJOR: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    """Program (head, n block): out[0, head, n block] = sum over K steps of W tile . x slice."""
    head = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    w_head = w + head * stride_w0
    tile = _w_tile(w_head, offs_n, offs_k, stride_w1, n, k, K_MAJOR)
    pdl_wait(USE_PDL)
    xv = tl.load(x + head * stride_xh + offs_k, mask=offs_k < k, other=0.0).to(tl.float32)
    acc = tl.sum(tile * xv[None, :], axis=1)  # [BLOCK_N]
    for k0 in range(BLOCK_K, k, BLOCK_K):
        tile = _w_tile(w_head, offs_n, k0 + offs_k, stride_w1, n, k, K_MAJOR)
        xv = tl.load(x + head * stride_xh + k0 + offs_k, mask=k0 + offs_k < k,
                     other=0.0).to(tl.float32)
        acc += tl.sum(tile * xv[None, :], axis=1)
    tl.store(out + head * n + offs_n, acc.to(out.dtype.element_ty), mask=offs_n < n)
