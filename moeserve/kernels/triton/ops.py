"""Triton kernels for the small per-layer ops of decode: RMSNorm (+ residual add), Qwen3's per-head
q/k RMSNorm + neox rope, MLA's rope + latent norm (mla_rope.py) and per-head absorbed
products (head_gemv.py), the routers, and small-M linears (gemv.py), each one
launch.

Why: at batch 1 the GPU decode step is launch-bound, and these ops were chains of tiny torch
kernels (about 5, 12 and 6 per layer). `TritonOps` mirrors the `CpuKernels` methods it replaces
(same signatures, same rounding as the torch paths in `layers/`), so a module holds it in a
`gpu_ops` attribute next to `cpu_kernels` (given by `kernels.attach.attach_ops`).

Every method launches nothing for T = 0, never syncs with the host and allocates only
shape-determined outputs: safe under CUDA graph capture. Unlike the CPU kernel, positions beyond the
rope table are not checked (that would be a host sync). Without CUDA the kernels run in Triton's
interpreter (TRITON_INTERPRET=1 before this import; float32 only: its bf16 math is wrong).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Protocol

import torch

from moeserve.kernels.fp8_format import FP8

if TYPE_CHECKING:
    from moeserve.kernels.triton.attention import KVStoreTarget

try:  # optional: only the CUDA image has Triton
    import triton
    import triton.language as tl

    from moeserve.kernels.triton.gemv import GEMV_DTYPES, LINEAR_MAX_M, gemv
    from moeserve.kernels.triton.head_gemv import head_gemv
    from moeserve.kernels.triton.mla_rope import mla_rope_norm
    from moeserve.kernels.triton.pdl import launch_kwargs, pdl_wait
    from moeserve.kernels.triton.router_topk import grouped_topk, router_topk, softmax_topk_store
except ImportError:  # pragma: no cover - CPU installs
    triton = None

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # read at import, as @triton.jit does


class GroupedRouting(Protocol):
    """The router settings `grouped_topk` reads (layers/router.py's RouterConfig has them)."""

    top_k: int
    scoring: str  # softmax | sigmoid
    renormalize: bool
    num_groups: int
    topk_groups: int
    group_score: str  # max | top2_sum
    routed_scaling_factor: float


def _warps(block: int, per_warp: int, most: int) -> int:
    """Warps for a program over `block` elements, about `per_warp` each (a power of two)."""
    return max(1, min(most, block // per_warp))


class TritonOps:
    """One-launch replacements of small torch op chains. Tensors are on one CUDA device (the
    current one: Triton launches there), or on the CPU under the interpreter; see `usable`.
    `pdl`: launch them as programmatic dependent launches (pdl.py; CUDA sm90+ only)."""

    def __init__(self, pdl: bool = False):
        self.pdl = pdl

    def usable(self, t: torch.Tensor) -> bool:
        """Whether the kernels can run on t's device (CUDA, or the CPU under the interpreter)."""
        return triton is not None and (t.is_cuda or (_INTERPRET and t.device.type == "cpu"))

    def linear(self, x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor | None:
        """F.linear(x, weight, bias) by the small-M GEMV where x [..., K] has at most LINEAR_MAX_M
        rows (where it beats cuBLAS, gemv.py) and the dtype of a plain 2-D float weight
        (bf16/fp16/fp32, unit column stride), and no gradient is wanted (the kernel has no
        backward); None where not (the caller runs F.linear). Only static shapes decide: a
        captured graph keeps its choice."""
        k = x.shape[-1]
        if (x.numel() > LINEAR_MAX_M * k or weight.dim() != 2 or weight.shape[1] != k
                or x.dtype not in GEMV_DTYPES or weight.dtype != x.dtype or weight.stride(1) != 1
                or (bias is not None and bias.dtype != x.dtype)
                or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
            return None
        x2 = x.reshape(-1, k)  # [M, K]
        if x2.stride(1) != 1:
            x2 = x2.contiguous()
        return gemv(x2, weight, bias, pdl=self.pdl).view(*x.shape[:-1], weight.shape[0])

    def router_logits(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
        """float32 router logits x.float() @ weight^T for x [T, H] of at most LINEAR_MAX_M rows
        and a float32 weight [E, H] (DeepSeek's gate), by the GEMV reading x as it is: one
        launch where torch ran a cast and cuBLAS's float32 GEMV (~9 µs a layer on the H200);
        None where it does not apply."""
        if (x.dim() != 2 or x.shape[0] > LINEAR_MAX_M or x.dtype not in GEMV_DTYPES
                or weight.dtype != torch.float32 or weight.dim() != 2
                or weight.shape[1] != x.shape[1] or weight.stride(1) != 1
                or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
            return None
        x = x if x.stride(1) == 1 else x.contiguous()
        return gemv(x, weight, pdl=self.pdl, out_dtype=torch.float32)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None):
        """RMSNorm of x [T, N] (rows may be strided) as `layers.norm.RMSNorm` computes it; with a
        residual, (norm(x + residual), x + residual). Outputs are fresh tensors: the callers'
        x and residual are left as they were."""
        t, n = x.shape
        assert x.stride(1) == 1 and weight.dtype == x.dtype and weight.is_contiguous()
        out = torch.empty((t, n), dtype=x.dtype, device=x.device)
        res_out = None
        if residual is not None:
            assert residual.is_contiguous() and residual.dtype == x.dtype
            res_out = torch.empty((t, n), dtype=x.dtype, device=x.device)
        if t:
            block = triton.next_power_of_2(n)
            _rms_norm_kernel[(t,)](
                out, out if res_out is None else res_out, x, x.stride(0),
                x if residual is None else residual, weight, eps, N=n,
                HAS_RES=residual is not None, BLOCK=block, num_warps=_warps(block, 256, 16),
                **launch_kwargs(self.pdl))
        return out if residual is None else (out, res_out)

    def qk_norm_rope(self, qkv: torch.Tensor, num_q: int, num_k: int, head_dim: int,
                     positions: torch.Tensor, table: torch.Tensor, rotary_dim: int,
                     q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                     eps: float, store: KVStoreTarget | None = None) -> None:
        """In place on qkv [T, >= (num_q + num_k) * head_dim]: per-head RMSNorm of the q and k
        heads (when weights are given), then neox rope on each head's first rotary_dim channels
        with `table` [P, 2 * rotary_dim] float32 (cos | cos | -sin | sin) at each token's
        position; as `rms_norm_heads` then `RotaryEmbedding.rotate`. One program per (token,
        block of heads).

        `store` (the attention backend's `kv_store_target`): also write each token's final k
        heads and its v heads (qkv's next num_k * head_dim channels) into the KV pool at
        `store.loc[t]`, so the step needs no separate KV-store launch."""
        t = qkv.shape[0]
        assert qkv.stride(1) == 1 and table.dtype == torch.float32 and table.is_contiguous()
        assert rotary_dim % 2 == 0 and 0 < rotary_dim <= head_dim
        assert table.shape[1] == 2 * rotary_dim and positions.dim() == 1
        has_norm = q_weight is not None
        if has_norm:
            assert k_weight is not None and q_weight.is_contiguous() and k_weight.is_contiguous()
            assert q_weight.dtype == k_weight.dtype  # one pointer type in the kernel's branch
        if t == 0:
            return
        half = triton.next_power_of_2(rotary_dim // 2)
        rest = head_dim - rotary_dim
        dummy = table  # stands for absent weights (never read)
        heads = num_q + num_k
        # ~2k channels per program: one launch's programs stay a few per token (measured at
        # 2048 tokens x 40 heads: one head per program took 46 µs for ~21 MB)
        block_heads = min(triton.next_power_of_2(heads), max(1, 1024 // half))
        if store is not None:
            assert store.k_buf.dtype == qkv.dtype == store.v_buf.dtype  # no cast on the way
            assert store.k_buf.shape[1:] == (num_k, head_dim) == store.v_buf.shape[1:]
            assert store.k_buf.stride(2) == 1 and store.v_buf.stride(1) == head_dim
            assert qkv.shape[1] >= (heads + num_k) * head_dim
        k_buf, v_buf, loc = store if store is not None else (qkv, qkv, positions)  # unread
        _qk_norm_rope_kernel[(t, triton.cdiv(heads, block_heads))](
            qkv, qkv.stride(0), positions, positions.stride(0), table,
            q_weight if has_norm else dummy, k_weight if has_norm else dummy, eps,
            k_buf, v_buf, loc, k_buf.stride(0), k_buf.stride(1), v_buf.stride(0),
            NUM_Q=num_q, NUM_HEADS=heads, D=head_dim, ROT=rotary_dim, HAS_NORM=has_norm,
            BLOCK_HEADS=block_heads, BLOCK_HALF=half,
            BLOCK_REST=triton.next_power_of_2(max(rest, 1)), HAS_REST=rest > 0,
            STORE=store is not None, BLOCK_V=triton.next_power_of_2(num_k * head_dim),
            num_warps=_warps(half * block_heads, 256, 8),
            # no FMA contraction: x1 * cos + x2 * -sin rounds as the torch path's mul, mul, add
            enable_fp_fusion=False, **launch_kwargs(self.pdl))

    def mla_rope_norm(self, q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor,
                      table: torch.Tensor, interleaved: bool, norm_weight: torch.Tensor,
                      eps: float, store: KVStoreTarget | None = None) -> torch.Tensor:
        """MLA's rope on q's rope channels (in place), the latent's norm + rope (and its KV
        store) in one launch → latent [T, 1, R + r] (mla_rope.py)."""
        return mla_rope_norm(q, kv, positions, table, interleaved, norm_weight, eps, store,
                             pdl=self.pdl)

    def head_gemv(self, x: torch.Tensor, w: torch.Tensor, k_major: bool,
                  w_scale: torch.Tensor | None = None,
                  block: tuple[int, int] | None = None) -> torch.Tensor | None:
        """One token's per-head products x [1, H, K] @ w[h] (w [H, K, N], k_major) or @ w[h]^T
        (w [H, N, K]) in one launch (head_gemv.py): MLA's absorbed W_UK / W_UV at
        decode; with `w_scale` and `block`, w is e4m3 (FP8-resident kv_b_proj). None where it
        does not apply (more tokens, dtypes differ, unaligned FP8 heads, a gradient wanted)."""
        w_ok = (w.dtype == x.dtype if w_scale is None
                else w.dtype == FP8 and w_scale.dtype == torch.float32)
        if (x.dim() != 3 or x.shape[0] != 1 or w.dim() != 3 or w.shape[0] != x.shape[1]
                or not w_ok or x.dtype not in GEMV_DTYPES or x.stride(2) != 1
                or w.stride(2) != 1 or w.shape[1 if k_major else 2] != x.shape[2]
                or (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))):
            return None
        return head_gemv(x, w, k_major, pdl=self.pdl, w_scale=w_scale, block=block)

    def router_topk(self, x: torch.Tensor, weight: torch.Tensor, k: int, renormalize: bool):
        """One token's router linear and softmax top-k in one launch (router_topk.py): (weights,
        ids) as `topk_softmax(linear(x, weight))`, or None where it does not apply."""
        if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
            return None
        return router_topk(x, weight, k, renormalize, pdl=self.pdl)

    def grouped_topk(self, logits: torch.Tensor, cfg: GroupedRouting,
                     correction_bias: torch.Tensor | None):
        """`select_experts` for any router config in one launch (router_topk.py), or None where
        its shapes or dtypes do not fit (the caller runs torch ops)."""
        return grouped_topk(logits, cfg.top_k, cfg.scoring == "sigmoid", correction_bias,
                            cfg.num_groups, cfg.topk_groups, cfg.group_score == "top2_sum",
                            cfg.renormalize, cfg.routed_scaling_factor, pdl=self.pdl)

    def topk_softmax(self, logits: torch.Tensor, k: int, renormalize: bool):
        """logits [T, E] (any float dtype) → (weights [T, k] float32, ids [T, k] int64) of the
        float32 softmax's top-k (largest first; equal values: lower expert id first), divided
        by their sum when `renormalize`; as `select_experts` with a plain softmax router."""
        t, e = logits.shape
        assert logits.is_contiguous() and 0 < k <= e
        weights = torch.empty((t, k), dtype=torch.float32, device=logits.device)
        ids = torch.empty((t, k), dtype=torch.int64, device=logits.device)
        if t:
            block = triton.next_power_of_2(e)
            _topk_softmax_kernel[(t,)](
                weights, ids, logits, E=e, K=k, RENORM=bool(renormalize), BLOCK_E=block,
                BLOCK_K=triton.next_power_of_2(k), num_warps=_warps(block, 128, 8),
                **launch_kwargs(self.pdl))
        return weights, ids


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(out, res_out, x, x_stride, res, weight, eps, N: tl.constexpr,
                         HAS_RES: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
        """One row: the sum rounded to x's dtype (and stored), normalised in float32, rounded,
        times the weight in float32, rounded: RMSNorm's torch rounding sequence."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        dt = x.dtype.element_ty
        w = tl.load(weight + cols, mask=mask, other=0.0).to(tl.float32)  # a parameter
        pdl_wait(USE_PDL)
        v = tl.load(x + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_RES:
            r = tl.load(res + row * N + cols, mask=mask, other=0.0).to(tl.float32)
            s = (v + r).to(dt)
            tl.store(res_out + row * N + cols, s, mask=mask)
            v = s.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(v * v, axis=0) / N + eps)
        h = (v * rstd).to(dt).to(tl.float32)
        tl.store(out + row * N + cols, (w * h).to(dt), mask=mask)

    @triton.jit
    def _norm_part(v, q_weight, k_weight, is_q, offs, mask, rstd, dt: tl.constexpr):
        """weight * round(v * rstd) for [heads, channels] tiles, the q or k weight per head,
        rounded as `rms_norm_heads` does, back in float32."""
        wq = tl.load(q_weight + offs, mask=mask & is_q, other=0.0).to(tl.float32)
        wk = tl.load(k_weight + offs, mask=mask & (~is_q), other=0.0).to(tl.float32)
        w = tl.where(is_q, wq, wk)
        return (w * (v * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)

    @triton.jit
    def _qk_norm_rope_kernel(qkv, row_stride, positions, pos_stride, table, q_weight, k_weight,
                             eps, k_buf, v_buf, loc, stride_kbt, stride_kbh, stride_vbt,
                             NUM_Q: tl.constexpr, NUM_HEADS: tl.constexpr, D: tl.constexpr,
                             ROT: tl.constexpr, HAS_NORM: tl.constexpr, BLOCK_HEADS: tl.constexpr,
                             BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr,
                             HAS_REST: tl.constexpr, STORE: tl.constexpr, BLOCK_V: tl.constexpr,
                             USE_PDL: tl.constexpr):
        """BLOCK_HEADS heads of one token, each held as its two rotated halves and the
        unrotated rest: the rope partners sit in registers (no read of a channel another thread
        may have written). STORE: the k heads also go to k_buf[loc[t]], and the token's v heads
        (by the first head block's program) to v_buf[loc[t]]."""
        pdl_wait(USE_PDL)
        t = tl.program_id(0).to(tl.int64)
        heads = tl.program_id(1) * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)  # [BH]
        HALF: tl.constexpr = ROT // 2
        dt = qkv.dtype.element_ty
        base = qkv + t * row_stride + heads[:, None] * D  # [BH, 1]
        i = tl.arange(0, BLOCK_HALF)
        mh = heads < NUM_HEADS
        mi = mh[:, None] & (i < HALF)[None, :]  # [BH, BLOCK_HALF]
        x1 = tl.load(base + i[None, :], mask=mi, other=0.0).to(tl.float32)
        x2 = tl.load(base + HALF + i[None, :], mask=mi, other=0.0).to(tl.float32)
        if HAS_REST:
            j = tl.arange(0, BLOCK_REST)
            mj = mh[:, None] & (j < D - ROT)[None, :]
            if HAS_NORM or STORE:
                xr = tl.load(base + ROT + j[None, :], mask=mj, other=0.0).to(tl.float32)
        if HAS_NORM:
            ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)  # [BH]
            if HAS_REST:
                ss += tl.sum(xr * xr, axis=1)
            rstd = tl.rsqrt(ss / D + eps)[:, None]
            is_q = (heads < NUM_Q)[:, None]
            x1 = _norm_part(x1, q_weight, k_weight, is_q, i[None, :], mi, rstd, dt)
            x2 = _norm_part(x2, q_weight, k_weight, is_q, HALF + i[None, :], mi, rstd, dt)
            if HAS_REST:
                xr = _norm_part(xr, q_weight, k_weight, is_q, ROT + j[None, :], mj, rstd, dt)
                tl.store(base + ROT + j[None, :], xr.to(dt), mask=mj)
        pos = tl.load(positions + t * pos_stride).to(tl.int64)
        row = table + pos * (2 * ROT)  # cos | cos | -sin | sin
        mr = i < HALF
        cos1 = tl.load(row + i, mask=mr, other=0.0)[None, :]
        cos2 = tl.load(row + HALF + i, mask=mr, other=0.0)[None, :]
        nsin1 = tl.load(row + ROT + i, mask=mr, other=0.0)[None, :]
        sin2 = tl.load(row + ROT + HALF + i, mask=mr, other=0.0)[None, :]
        y1 = (x1 * cos1 + x2 * nsin1).to(dt)
        y2 = (x2 * cos2 + x1 * sin2).to(dt)
        tl.store(base + i[None, :], y1, mask=mi)
        tl.store(base + HALF + i[None, :], y2, mask=mi)
        if STORE:
            slot = tl.load(loc + t).to(tl.int64)
            is_k = mh & (heads >= NUM_Q)
            kb = k_buf + slot * stride_kbt + (heads - NUM_Q)[:, None] * stride_kbh  # [BH, 1]
            mk = is_k[:, None] & (i < HALF)[None, :]
            tl.store(kb + i[None, :], y1, mask=mk)
            tl.store(kb + HALF + i[None, :], y2, mask=mk)
            if HAS_REST:
                mkr = is_k[:, None] & (j < D - ROT)[None, :]
                tl.store(kb + ROT + j[None, :], xr.to(dt), mask=mkr)
            if tl.program_id(1) == 0:  # the v heads, contiguous after q and k: one row copy
                c = tl.arange(0, BLOCK_V)
                mv = c < (NUM_HEADS - NUM_Q) * D
                v = tl.load(qkv + t * row_stride + NUM_HEADS * D + c, mask=mv)
                tl.store(v_buf + slot * stride_vbt + c, v, mask=mv)

    @triton.jit
    def _topk_softmax_kernel(weights, ids, logits, E: tl.constexpr, K: tl.constexpr,
                             RENORM: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                             USE_PDL: tl.constexpr):
        """One token: float32 softmax, then K rounds of (max, lowest id holding it, mask it)."""
        pdl_wait(USE_PDL)
        t = tl.program_id(0).to(tl.int64)
        e = tl.arange(0, BLOCK_E)
        x = tl.load(logits + t * E + e, mask=e < E, other=float("-inf")).to(tl.float32)
        softmax_topk_store(x, weights, ids, t, E, K, RENORM, BLOCK_E, BLOCK_K)
