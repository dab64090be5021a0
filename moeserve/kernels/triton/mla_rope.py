"""MLA's per-layer small ops in one launch: rope on q's rope channels (in place), the latent's
RMSNorm (kv_a_layernorm) and rope on its rope part, the latent written out and, optionally, into
the KV pool.

Why: at decode MLA's `prepare` between the projections was a chain of ~12 tiny torch kernels a
layer (cat of q_pe and k_pe, the cos/sin gather, float casts, the pair products, stack, cast back,
split, the norm, the latent's cat, the KV store): on a batch-1 DeepSeek-V3 step they were ~20 µs
a layer of launches for a few KB of data (H200 profile, docs/gpu_decode.md).

Rounding follows the torch path exactly (`RMSNorm`, `RotaryEmbedding.rotate`): the norm as the
Triton RMSNorm does it, rope in float32 without FMA contraction, each result rounded once to the
activations' dtype. Rope styles: interleaved pairs (x[2i], x[2i+1]; table [P, r] = cos | sin,
DeepSeek's default) and neox halves (table [P, 2r] = cos | cos | -sin | sin).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from moeserve.kernels.triton.pdl import launch_kwargs, pdl_wait

if TYPE_CHECKING:
    from moeserve.kernels.triton.attention import KVStoreTarget

HEADS_PER_PROGRAM = 16  # q heads whose rope channels one program rotates


def mla_rope_norm(q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor,
                  table: torch.Tensor, interleaved: bool, norm_weight: torch.Tensor, eps: float,
                  store: KVStoreTarget | None = None, pdl: bool = False) -> torch.Tensor:
    """q [T, H, nope + r] (unit last stride; rope on its last r channels, in place), kv [T, R + r]
    (kv_a_proj's output, unit last stride) → latent [T, 1, R + r] = norm(kv[:, :R]) |
    rope(kv[:, R:]). `store`: also write the latent rows to store.k_buf [slots + 1, 1, R + r] at
    store.loc (the MLA pool; the caller then skips the backend's store)."""
    t, h, dq = q.shape
    r = table.shape[1] // (1 if interleaved else 2)
    big_r = kv.shape[1] - r
    assert q.stride(2) == 1 and kv.stride(1) == 1 and table.dtype == torch.float32
    assert r % 2 == 0 and dq >= r and norm_weight.shape == (big_r,) and table.is_contiguous()
    assert norm_weight.dtype == kv.dtype == q.dtype and positions.dim() == 1
    latent = torch.empty((t, 1, big_r + r), dtype=kv.dtype, device=kv.device)
    if store is not None:
        assert store.k_buf.dtype == kv.dtype and store.k_buf.shape[1:] == (1, big_r + r)
        assert store.k_buf.stride(2) == 1
    if t == 0:
        return latent
    k_buf, loc = (store.k_buf, store.loc) if store is not None else (latent, positions)  # unread
    _mla_rope_norm_kernel[(t, 1 + triton.cdiv(h, HEADS_PER_PROGRAM))](
        q, q.stride(0), q.stride(1), kv, kv.stride(0), positions, table, norm_weight, eps,
        latent, k_buf, k_buf.stride(0), loc, H=h, Q_OFF=dq - r, R=big_r, ROT=r,
        INTERLEAVED=interleaved, STORE=store is not None, BLOCK_R=triton.next_power_of_2(big_r),
        BLOCK_HALF=triton.next_power_of_2(r // 2), BLOCK_HEADS=HEADS_PER_PROGRAM, num_warps=4,
        # no FMA contraction: x1 * cos - x2 * sin rounds as the torch path's mul, mul, sub
        enable_fp_fusion=False, **launch_kwargs(pdl))
    return latent


@triton.jit
def _rope_pairs(x1, x2, cos, sin):
    """(x1 cos - x2 sin, x2 cos + x1 sin) in float32, each product rounded (no FMA)."""
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit
def _mla_rope_norm_kernel(q, q_stride_t, q_stride_h, kv, kv_stride, positions, table, weight, eps,
                          latent, k_buf, k_stride, loc, H: tl.constexpr, Q_OFF: tl.constexpr,
                          R: tl.constexpr, ROT: tl.constexpr, INTERLEAVED: tl.constexpr,
                          STORE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr,
                          BLOCK_HEADS: tl.constexpr, USE_PDL: tl.constexpr):
    """Program (token, 0): the latent row; program (token, j >= 1): rope on q heads of block
    j - 1. Rope's pair i is channels (2i, 2i + 1) interleaved, (i, i + ROT/2) neox."""
    t = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    i = tl.arange(0, BLOCK_HALF)
    mi = i < ROT // 2
    if INTERLEAVED:  # table row: cos | sin
        c1, c2 = 2 * i, 2 * i + 1
        sin_off = ROT // 2
        row_len = ROT
    else:  # table row: cos | cos | -sin | sin
        c1, c2 = i, i + ROT // 2
        sin_off = ROT + ROT // 2
        row_len = 2 * ROT
    pdl_wait(USE_PDL)
    pos = tl.load(positions + t).to(tl.int64)
    cos = tl.load(table + pos * row_len + i, mask=mi, other=0.0)
    sin = tl.load(table + pos * row_len + sin_off + i, mask=mi, other=0.0)
    dt = kv.dtype.element_ty
    if part == 0:
        cols = tl.arange(0, BLOCK_R)
        mr = cols < R
        v = tl.load(kv + t * kv_stride + cols, mask=mr, other=0.0).to(tl.float32)
        w = tl.load(weight + cols, mask=mr, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(v * v, axis=0) / R + eps)  # as ops.py's _rms_norm_kernel
        normed = (w * (v * rstd).to(dt).to(tl.float32)).to(dt)
        k1 = tl.load(kv + t * kv_stride + R + c1, mask=mi, other=0.0).to(tl.float32)
        k2 = tl.load(kv + t * kv_stride + R + c2, mask=mi, other=0.0).to(tl.float32)
        r1, r2 = _rope_pairs(k1, k2, cos, sin)
        row = latent + t * (R + ROT)
        tl.store(row + cols, normed, mask=mr)
        tl.store(row + R + c1, r1.to(dt), mask=mi)
        tl.store(row + R + c2, r2.to(dt), mask=mi)
        if STORE:
            slot = tl.load(loc + t).to(tl.int64)
            dst = k_buf + slot * k_stride
            tl.store(dst + cols, normed, mask=mr)
            tl.store(dst + R + c1, r1.to(dt), mask=mi)
            tl.store(dst + R + c2, r2.to(dt), mask=mi)
    else:
        heads = (part - 1) * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)
        m = (heads < H)[:, None] & mi[None, :]
        base = q + t * q_stride_t + heads.to(tl.int64)[:, None] * q_stride_h + Q_OFF
        x1 = tl.load(base + c1[None, :], mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(base + c2[None, :], mask=m, other=0.0).to(tl.float32)
        o1, o2 = _rope_pairs(x1, x2, cos[None, :], sin[None, :])
        tl.store(base + c1[None, :], o1.to(dt), mask=m)
        tl.store(base + c2[None, :], o2.to(dt), mask=m)
