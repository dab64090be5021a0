"""Routers in Triton: the softmax top-k selection per token (shared with `TritonOps.topk_softmax`);
for one token, the router GEMV and that selection in one launch; DeepSeek's grouped top-k (sigmoid
or softmax scores, correction bias, group-limited choice) in one launch per batch, where torch ops
took ~15 small kernels (~30 µs of a batch-1 step per MoE layer on an H200).

Why one launch: a batch-1 decode step is bound by its ~10 launches per layer, and the router was
two of them (a 128-row GEMV of ~2 µs and a top-k of ~2 µs, each with its launch gap). Here the
GEMV's programs each write their rows of logits and count their arrival; the last program to
arrive (acq_rel counter, as the FP8 split-K reduction) reads all E logits back from L2 and
selects. The logits are rounded to x's dtype before the softmax, as the two-launch path stores
them, so both choose the same experts.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from moeserve.kernels.triton.gemv import GEMV_DTYPES, block_k_for
from moeserve.kernels.triton.pdl import launch_kwargs, pdl_wait

ROUTER_MAX_EXPERTS = 1024  # E the last program holds in registers


@functools.cache
def _arrival_counter(device: torch.device) -> torch.Tensor:
    """One counter, zero between launches (the last program resets it). NOTE: launches on one
    device run in stream order, as moeserve's forward does; allocated at the first (eager) call."""
    return torch.zeros(1, dtype=torch.int32, device=device)


def router_topk(x: torch.Tensor, w: torch.Tensor, k: int, renormalize: bool,
                pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
    """One token: logits = x [1, H] @ w [E, H]^T (rounded to x.dtype), then the float32 softmax's
    top-k → (weights [1, k] float32, ids [1, k] int64), as `TritonOps.topk_softmax` on the
    linear's output. None where it does not apply (more rows, another dtype, E too large): the
    caller runs the two-launch path. Graph-safe: shapes decide, no host sync. `pdl`: a
    programmatic dependent launch (pdl.py) whose first row step of w (a parameter)
    loads before the wait."""
    if (x.dim() != 2 or x.shape[0] != 1 or x.dtype not in GEMV_DTYPES or w.dtype != x.dtype
            or w.dim() != 2 or w.shape[1] != x.shape[1] or w.shape[0] > ROUTER_MAX_EXPERTS
            or x.stride(1) != 1 or w.stride(1) != 1 or not 0 < k <= w.shape[0]):
        return None
    e, h = w.shape
    logits = torch.empty((e,), dtype=x.dtype, device=x.device)
    weights = torch.empty((1, k), dtype=torch.float32, device=x.device)
    ids = torch.empty((1, k), dtype=torch.int64, device=x.device)
    block_e = triton.next_power_of_2(e)
    block_k = block_k_for(h, 1) if x.is_cuda else triton.next_power_of_2(h)
    _router_topk_kernel[(e,)](
        x, w, logits, weights, ids, _arrival_counter(x.device), h, w.stride(0), E=e, K=k,
        RENORM=bool(renormalize), BLOCK_H=block_k, BLOCK_E=block_e,
        BLOCK_K=triton.next_power_of_2(k), num_warps=4, **launch_kwargs(pdl))
    return weights, ids


@triton.jit
def softmax_topk_store(x, weights, ids, t, E: tl.constexpr, K: tl.constexpr,
                       RENORM: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """Token t's float32 logits x [BLOCK_E] (-inf past E): softmax, then K rounds of (max,
    lowest id holding it, mask it); stores weights [K] (renormalised if RENORM) and ids [K]."""
    e = tl.arange(0, BLOCK_E)
    p = tl.exp(x - tl.max(x, axis=0))
    p = p / tl.sum(p, axis=0)
    p = tl.where(e < E, p, -1.0)  # padding: below every probability, never chosen
    ks = tl.arange(0, BLOCK_K)
    w_acc = tl.zeros([BLOCK_K], dtype=tl.float32)
    id_acc = tl.zeros([BLOCK_K], dtype=tl.int32)
    for j in tl.static_range(K):
        best = tl.max(p, axis=0)
        idx = tl.minimum(tl.min(tl.where(p == best, e, BLOCK_E), axis=0), E - 1)  # NaN: E-1
        w_acc = tl.where(ks == j, best, w_acc)
        id_acc = tl.where(ks == j, idx, id_acc)
        p = tl.where(e == idx, -2.0, p)  # taken
    if RENORM:
        w_acc = w_acc / tl.sum(w_acc, axis=0)  # lanes >= K hold 0
    mk = ks < K
    tl.store(weights + t * K + ks, w_acc, mask=mk)
    tl.store(ids + t * K + ks, id_acc.to(tl.int64), mask=mk)


@triton.jit
def _router_topk_kernel(x_ptr, w_ptr, logits, weights, ids, counter, H, stride_w,
                        E: tl.constexpr, K: tl.constexpr, RENORM: tl.constexpr,
                        BLOCK_H: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                        USE_PDL: tl.constexpr):
    """Program e: logit e in float32 over BLOCK_H steps of the row (as the GEMV's one-row
    programs), rounded to x's dtype; the last program to arrive selects."""
    n = tl.program_id(0)
    offs = tl.arange(0, BLOCK_H)
    w_row = w_ptr + n.to(tl.int64) * stride_w
    w = tl.load(w_row + offs, mask=offs < H, other=0.0)  # weights: before the PDL wait
    pdl_wait(USE_PDL)
    xv = tl.load(x_ptr + offs, mask=offs < H, other=0.0)
    acc = w.to(tl.float32) * xv.to(tl.float32)
    for h0 in range(BLOCK_H, H, BLOCK_H):
        ok = offs < H - h0
        w = tl.load(w_row + h0 + offs, mask=ok, other=0.0)
        xv = tl.load(x_ptr + h0 + offs, mask=ok, other=0.0)
        acc += w.to(tl.float32) * xv.to(tl.float32)
    tl.store(logits + n, tl.sum(acc, axis=0).to(logits.dtype.element_ty))
    tl.debug_barrier()  # the logit is written before the count moves
    if tl.atomic_add(counter, 1, sem="acq_rel") == E - 1:
        e = tl.arange(0, BLOCK_E)
        x = tl.load(logits + e, mask=e < E, other=float("-inf"), cache_modifier=".cg")
        softmax_topk_store(x.to(tl.float32), weights, ids, 0, E, K, RENORM, BLOCK_E, BLOCK_K)
        tl.atomic_xchg(counter, 0)  # zero again for the next launch


def grouped_topk(logits: torch.Tensor, k: int, sigmoid: bool, bias: torch.Tensor | None,
                 num_groups: int, topk_groups: int, top2_sum: bool, renormalize: bool,
                 scale: float, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
    """DeepSeek's router per token in one launch: sigmoid or softmax scores, the choice steered
    by `bias`, only the experts of the `topk_groups` best of `num_groups` groups (group score:
    its max, or the sum of its top two), top-k by choice, weights = the chosen scores
    (renormalised: / (sum + 1e-20) for sigmoid, / sum for softmax) x scale; as
    `layers.router.select_experts`. logits [T, E] float32, E and E / num_groups powers of two
    (the groups are a [G, E/G] view of the row); None where not (the caller runs torch ops)."""
    t, e = logits.shape
    if (logits.dtype != torch.float32 or not logits.is_contiguous() or e > ROUTER_MAX_EXPERTS
            or e & (e - 1) or e % num_groups or not 0 < k <= e
            or not 0 < topk_groups <= num_groups
            or (bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()))):
        return None
    weights = torch.empty((t, k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((t, k), dtype=torch.int64, device=logits.device)
    if t:
        _grouped_topk_kernel[(t,)](
            logits, logits if bias is None else bias, weights, ids, scale, E=e, K=k,
            SIGMOID=sigmoid, HAS_BIAS=bias is not None, G=num_groups, TG=topk_groups,
            TOP2=top2_sum, RENORM=renormalize, BLOCK_K=triton.next_power_of_2(k),
            num_warps=4 if e >= 256 else 2, **launch_kwargs(pdl))
    return weights, ids


@triton.jit
def _grouped_topk_kernel(logits, bias, weights, ids, scale, E: tl.constexpr, K: tl.constexpr,
                         SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, G: tl.constexpr,
                         TG: tl.constexpr, TOP2: tl.constexpr, RENORM: tl.constexpr,
                         BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    """One token. Ties anywhere go to the lower id (group or expert)."""
    pdl_wait(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, E)
    x = tl.load(logits + t * E + e)
    if SIGMOID:
        s = 1.0 / (1.0 + tl.exp(-x))
    else:
        p = tl.exp(x - tl.max(x, axis=0))
        s = p / tl.sum(p, axis=0)
    c = s + tl.load(bias + e) if HAS_BIAS else s
    if G > 1:
        EG: tl.constexpr = E // G
        cg = tl.reshape(c, [G, EG])
        best = tl.max(cg, axis=1)  # [G]
        if TOP2:
            j = tl.arange(0, EG)[None, :]
            first = tl.min(tl.where(cg == best[:, None], j, EG), axis=1)
            best += tl.max(tl.where(j == first[:, None], float("-inf"), cg), axis=1)
        g = tl.arange(0, G)
        keep = g < 0
        for _ in tl.static_range(TG):
            top = tl.max(best, axis=0)
            gi = tl.min(tl.where(best == top, g, G), axis=0)
            keep = keep | (g == gi)
            best = tl.where(g == gi, float("-inf"), best)
        keep_e = tl.reshape(tl.broadcast_to(keep[:, None], [G, EG]), [E])
        c = tl.where(keep_e, c, float("-inf"))
    ks = tl.arange(0, BLOCK_K)
    w_acc = tl.zeros([BLOCK_K], dtype=tl.float32)
    id_acc = tl.zeros([BLOCK_K], dtype=tl.int32)
    for i in tl.static_range(K):
        top = tl.max(c, axis=0)
        idx = tl.min(tl.where(c == top, e, E), axis=0)
        w_acc = tl.where(ks == i, tl.sum(tl.where(e == idx, s, 0.0), axis=0), w_acc)
        id_acc = tl.where(ks == i, idx, id_acc)
        c = tl.where(e == idx, float("-inf"), c)
    if RENORM:
        total = tl.sum(w_acc, axis=0)  # lanes >= K hold 0
        w_acc = w_acc / (total + 1e-20) if SIGMOID else w_acc / total
    w_acc = w_acc * scale
    mk = ks < K
    tl.store(weights + t * K + ks, w_acc, mask=mk)
    tl.store(ids + t * K + ks, id_acc.to(tl.int64), mask=mk)
