"""Triton kernels over the token-slot KV pool: the KV store and split-KV (flash-decoding) decode.

Layouts (the pool's, see kvcache/pool.py): K and V buffers are [slots + 1, Hkv, D] with contiguous
rows; `req_to_token[row, pos]` is the slot of position `pos` of the request in table row `row`.

The key dim is split into a main part [0, dk) and an optional rope part [dk, dk + dpe) so that
absorbed MLA (dk = kv_lora_rank, dpe = rope dim, e.g. 512 + 64) runs on power-of-two blocks; its
value is the main part of the same K tile (`V_IS_K`: no second read). MHA/GQA: dpe = 0 and V has its
own buffer.

Decode is graph-safe: the grid is (batch, head blocks, NUM_SPLITS) and each program computes its
split of [0, seq_len) from the seq_lens tensor, so nothing depends on host-side lengths.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

try:  # optional: only installs with Triton have the triton attention backend
    import triton
    import triton.language as tl

    from moeserve.kernels.triton.pdl import launch_kwargs, pdl_wait
except ImportError:  # pragma: no cover - CPU installs
    triton = None

LOG2E = 1.4426950408889634
STORE_TILE = 4096  # elements per KV-store program
REDUCE_GROUPS = 1 << 16  # (request, head block) groups one fused decode launch may count on
FUSED_REDUCE_ROW = 1024  # heads x value channels a split adds to the fused reduction at most


class KVStoreTarget(NamedTuple):
    """Where a step's K/V rows go: k_buf/v_buf [slots + 1, Hkv, D] of one layer, loc [T] slots.
    Handed to a kernel that writes them as it produces them (`TritonOps.qk_norm_rope`)."""

    k_buf: torch.Tensor
    v_buf: torch.Tensor
    loc: torch.Tensor


def block_dim(n: int) -> int:
    """A tl.dot-able block for a dim of n (GPU tl.dot needs every dim >= 16)."""
    return max(16, triton.next_power_of_2(n))


# Shared memory a launch may plan for: under the H100/H200 opt-in limit (227 KB) with room for
# the compiler's own scratch (layout conversions, reductions).
SMEM_BUDGET = 180 * 1024


def attention_smem(elem: int, rows: int, block_n: int, dq: int, dv: int, v_is_k: bool,
                   stages: int) -> int:
    """Bytes of shared memory an attention program's tiles take (an estimate that bounds
    Triton's): the query rows [rows, dq], `stages` K (and V) tiles [block_n, dq (+ dv)] of
    `elem`-byte elements, and the float32 probabilities [rows, block_n]."""
    kv = block_n * (dq + (0 if v_is_k else dv)) * elem
    return rows * dq * elem + max(stages, 1) * kv + rows * block_n * 4


def fit_kv_tile(elem: int, rows: int, block_n: int, dq: int, dv: int, v_is_k: bool,
                stages: int) -> tuple[int, int]:
    """(block_n, stages) whose tiles fit SMEM_BUDGET: fewer pipeline stages first, then
    narrower key blocks (down to 16, tl.dot's minimum). Why: the bf16-sized tiles of MLA's
    512-channel latent in float32 asked for 240 KB, over the H100's 227 (issue 44)."""
    while attention_smem(elem, rows, block_n, dq, dv, v_is_k, stages) > SMEM_BUDGET:
        if stages > 1:
            stages -= 1
        elif block_n > 16:
            block_n //= 2
        else:
            raise ValueError(f"attention tiles of {rows} rows x {dq} channels in {elem}-byte "
                             f"elements do not fit {SMEM_BUDGET} bytes of shared memory")
    return block_n, stages


def store_kv(k: torch.Tensor, v: torch.Tensor | None, loc: torch.Tensor, k_buf: torch.Tensor,
             v_buf: torch.Tensor | None, pdl: bool = False) -> None:
    """k_buf[loc] = k and v_buf[loc] = v (cast to the pool dtype) in one launch.

    k: [T, Hkv, Dk], v: [T, Hkv, Dv] or None (MLA), loc: [T] slots; last dims contiguous.
    `pdl`: a programmatic dependent launch (pdl.py).
    """
    t, hkv, dk = k.shape
    if t == 0:
        return
    has_v = v is not None
    dv = v.shape[-1] if has_v else 0
    k = k.to(k_buf.dtype)  # a no-op when the dtypes agree (the usual case); rounds as torch does
    v = v.to(v_buf.dtype) if has_v else None
    v, v_buf = (v, v_buf) if has_v else (k, k_buf)  # unread placeholders
    block_k = triton.next_power_of_2(hkv * dk)
    block_v = triton.next_power_of_2(max(hkv * dv, 1))
    block_t = max(1, min(triton.next_power_of_2(t), STORE_TILE // max(block_k, block_v)))
    _store_kv_kernel[(triton.cdiv(t, block_t),)](
        k, v, loc, k_buf, v_buf, t,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        HEADS=hkv, DK=dk, DV=dv, HAS_V=has_v, BLOCK_T=block_t, BLOCK_K=block_k,
        BLOCK_V=block_v, num_warps=4, **launch_kwargs(pdl),
    )


@functools.cache
def split_counters(device: torch.device) -> torch.Tensor:
    """Arrival counters of the decode kernel's (request, head block) groups, zero between
    launches (each group's last split resets its own). NOTE: decode launches on one device run in
    stream order, as moeserve's forward does; allocated at the first (eager, warm-up) call."""
    return torch.zeros(REDUCE_GROUPS, dtype=torch.int32, device=device)


def decode_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor | None,
                     req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, dk: int, dv: int,
                     out: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor,
                     fuse_reduce: bool = True, pdl: bool = False) -> None:
    """One query per request over its KV positions [0, seq_len): out = softmax(q k^T * scale) v.

    q: [B, H, Dq] (Dq = dk + dpe), k_buf: [slots + 1, Hkv, >= Dq], v_buf: [slots + 1, Hkv, dv]
    or None (MLA: V = k_buf[..., :dv], needs dv == dk), out: [B, H, dv];
    scratch part_out: [B, H, S, dv] float32, part_lse: [B, H, S] float32, S = number of KV splits.
    fuse_reduce: the last split of each (request, head block) to finish combines the splits in
    the same launch (one launch fewer per layer: what a batch-1 step is bound by); else a second
    kernel does. Launches only from tensors and shapes (CUDA-graph safe). `pdl`: programmatic
    dependent launches (pdl.py).
    """
    b, h, dq = q.shape
    if b == 0:
        return
    hkv, splits = k_buf.shape[1], part_lse.shape[-1]
    group, dpe = h // hkv, dq - dk
    v_is_k = v_buf is None
    assert not v_is_k or dv == dk, "MLA: the value is the main part of the key"
    big = dk > 256  # MLA latent (512): fewer rows per program keep the tiles in registers
    block_h = 16 if big else block_dim(min(group, 64))
    heads_per_prog = min(group, block_h)
    progs_per_kv = triton.cdiv(group, heads_per_prog)
    v_buf = k_buf if v_is_k else v_buf
    grid = (b, hkv * progs_per_kv, splits)
    # one program reduces a group's splits serially: only where that is a small read (GQA's
    # few heads x 128; not MLA's 16 heads x 512 latent channels, which the second kernel spreads)
    fuse = (fuse_reduce and b * grid[1] <= REDUCE_GROUPS
            and heads_per_prog * block_dim(dv) <= FUSED_REDUCE_ROW)
    counters = split_counters(q.device) if fuse else seq_lens  # unread when not fused
    block_n, stages = fit_kv_tile(q.element_size(), block_h, 32 if big else 64,
                                  block_dim(dk) + (block_dim(dpe) if dpe > 0 else 0),
                                  block_dim(dv), v_is_k, 2)
    _decode_split_kernel[grid](
        q, k_buf, v_buf, req_to_token, req_pool_indices, seq_lens, part_out, part_lse,
        out, counters, scale * LOG2E, q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1),
        v_buf.stride(0), v_buf.stride(1), req_to_token.stride(0),
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1), out.stride(0), out.stride(1),
        group, dk, dpe, dv,
        HEADS_PER_PROG=heads_per_prog, PROGS_PER_KV=progs_per_kv, NUM_SPLITS=splits,
        BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_D=block_dim(dk),
        BLOCK_DPE=block_dim(max(dpe, 1)), BLOCK_DV=block_dim(dv), HAS_PE=dpe > 0,
        V_IS_K=v_is_k, FUSE_REDUCE=fuse, num_warps=4, num_stages=stages, **launch_kwargs(pdl),
    )
    if fuse:
        return
    _decode_reduce_kernel[(b, h)](
        part_out, part_lse, out,
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1), out.stride(0), out.stride(1), dv,
        NUM_SPLITS=splits, BLOCK_S=triton.next_power_of_2(splits),
        BLOCK_DV=triton.next_power_of_2(dv), num_warps=4, **launch_kwargs(pdl),
    )


if triton is not None:

    @triton.jit
    def _store_row_tile(src, dst, offs_t, mask_t, slots, stride_st, stride_sh, stride_dt,
                        stride_dh, HEADS: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)  # (head, channel) flattened
        col_s = (offs // D) * stride_sh + offs % D
        col_d = (offs // D) * stride_dh + offs % D
        mask = mask_t[:, None] & (offs < HEADS * D)[None, :]
        x = tl.load(src + offs_t[:, None] * stride_st + col_s[None, :], mask=mask)
        tl.store(dst + slots[:, None] * stride_dt + col_d[None, :], x, mask=mask)

    @triton.jit
    def _store_kv_kernel(k_ptr, v_ptr, loc_ptr, k_buf, v_buf, num_tokens,
                         stride_kt, stride_kh, stride_vt, stride_vh,
                         stride_kbt, stride_kbh, stride_vbt, stride_vbh,
                         HEADS: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                         HAS_V: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
                         BLOCK_V: tl.constexpr, USE_PDL: tl.constexpr):
        """Program: BLOCK_T tokens, their K (and V) rows of every KV head as [BLOCK_T, heads*D]."""
        pdl_wait(USE_PDL)
        offs_t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        mask_t = offs_t < num_tokens
        slots = tl.load(loc_ptr + offs_t, mask=mask_t, other=0).to(tl.int64)
        _store_row_tile(k_ptr, k_buf, offs_t, mask_t, slots, stride_kt, stride_kh, stride_kbt,
                        stride_kbh, HEADS, DK, BLOCK_K)
        if HAS_V:
            _store_row_tile(v_ptr, v_buf, offs_t, mask_t, slots, stride_vt, stride_vh,
                            stride_vbt, stride_vbh, HEADS, DV, BLOCK_V)

    @triton.jit
    def load_query(q_rows, mask_rows, dk, dpe, BLOCK_D: tl.constexpr, BLOCK_DPE: tl.constexpr,
                   HAS_PE: tl.constexpr):
        """Query rows [R, BLOCK_D] (the main dk channels) and, for MLA, the rope part
        [R, BLOCK_DPE] (channels dk..dk+dpe; the main part again when there is none)."""
        offs_d = tl.arange(0, BLOCK_D)
        q = tl.load(q_rows + offs_d[None, :], mask=mask_rows[:, None] & (offs_d[None, :] < dk),
                    other=0.0)
        if HAS_PE:
            offs_pe = dk + tl.arange(0, BLOCK_DPE)
            q_pe = tl.load(q_rows + offs_pe[None, :],
                           mask=mask_rows[:, None] & (offs_pe[None, :] < dk + dpe), other=0.0)
        else:
            q_pe = q
        return q, q_pe

    @triton.jit
    def attend_kv_block(q, q_pe, k_buf, v_buf, slots, mask_n, keep, kv_head, stride_kt,
                        stride_kh, stride_vt, stride_vh, dk, dpe, dv, scale_log2, m_i, l_i, acc,
                        BLOCK_D: tl.constexpr, BLOCK_DPE: tl.constexpr, BLOCK_DV: tl.constexpr,
                        HAS_PE: tl.constexpr, V_IS_K: tl.constexpr, MASKED: tl.constexpr):
        """One block of BLOCK_N keys at `slots` (valid where mask_n) into the online softmax of
        the query rows: `keep` [R, BLOCK_N] says which scores count (validity, causality); not
        MASKED: every score counts (`keep` unread). Shared by the decode and extend kernels;
        returns the updated (m_i, l_i, acc)."""
        offs_d = tl.arange(0, BLOCK_D)
        k_rows = k_buf + slots.to(tl.int64)[:, None] * stride_kt + kv_head * stride_kh
        k = tl.load(k_rows + offs_d[None, :], mask=mask_n[:, None] & (offs_d[None, :] < dk),
                    other=0.0).to(q.dtype)  # [BLOCK_N, BLOCK_D]
        qk = tl.dot(q, tl.trans(k))  # [R, BLOCK_N] float32
        if HAS_PE:
            offs_pe = dk + tl.arange(0, BLOCK_DPE)
            k_pe = tl.load(k_rows + offs_pe[None, :],
                           mask=mask_n[:, None] & (offs_pe[None, :] < dk + dpe),
                           other=0.0).to(q.dtype)
            qk += tl.dot(q_pe, tl.trans(k_pe))
        if MASKED:
            qk = tl.where(keep, qk * scale_log2, float("-inf"))
        else:
            qk = qk * scale_log2
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if V_IS_K:
            v = k  # BLOCK_DV == BLOCK_D, dv == dk
        else:
            offs_dv = tl.arange(0, BLOCK_DV)
            v_rows = v_buf + slots.to(tl.int64)[:, None] * stride_vt + kv_head * stride_vh
            v = tl.load(v_rows + offs_dv[None, :],
                        mask=mask_n[:, None] & (offs_dv[None, :] < dv), other=0.0)
            v = v.to(q.dtype)  # [BLOCK_N, BLOCK_DV]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        return m_new, l_i, acc

    @triton.jit
    def _decode_split_kernel(
        q_ptr, k_buf, v_buf, req_to_token, req_pool_indices, seq_lens, part_out, part_lse,
        out_ptr, counters, scale_log2, stride_qb, stride_qh, stride_kt, stride_kh, stride_vt,
        stride_vh, stride_rt, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
        stride_ob, stride_oh, group, dk, dpe, dv,
        HEADS_PER_PROG: tl.constexpr, PROGS_PER_KV: tl.constexpr, NUM_SPLITS: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_DPE: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_PE: tl.constexpr,
        V_IS_K: tl.constexpr, FUSE_REDUCE: tl.constexpr, USE_PDL: tl.constexpr,
    ):
        """Stage 1, program (request, head block, split): the query heads of the block (all on
        one KV head) over the split's KV positions; online softmax in base 2, float32. Writes the
        split's normalised output and log2-sum-exp (-inf, with a zero output, when empty).
        FUSE_REDUCE: the group's last split to arrive then does stage 2 for the block's heads."""
        pdl_wait(USE_PDL)
        b = tl.program_id(0)
        hb = tl.program_id(1)
        split = tl.program_id(2)
        kv_head = hb // PROGS_PER_KV
        offs_h = tl.arange(0, BLOCK_H)
        local = (hb % PROGS_PER_KV) * HEADS_PER_PROG + offs_h  # head index inside the group
        mask_h = (offs_h < HEADS_PER_PROG) & (local < group)
        heads = kv_head * group + local  # [BLOCK_H]
        seq_len = tl.load(seq_lens + b).to(tl.int32)
        row = tl.load(req_pool_indices + b).to(tl.int64)
        # each split a whole number of BLOCK_N, so only the last block of the sequence is partial
        # (integer ceil by hand: tl.cdiv is a jit function, costly per program in the interpreter)
        per_split = (seq_len + NUM_SPLITS - 1) // NUM_SPLITS
        per_split = (per_split + BLOCK_N - 1) // BLOCK_N * BLOCK_N
        start = split * per_split
        end = tl.minimum(start + per_split, seq_len)

        q_rows = q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh
        q, q_pe = load_query(q_rows, mask_h, dk, dpe, BLOCK_D, BLOCK_DPE, HAS_PE)
        offs_dv = tl.arange(0, BLOCK_DV)

        m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
        for n0 in range(start, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < end
            slots = tl.load(req_to_token + row * stride_rt + offs_n, mask=mask_n, other=0)
            m_i, l_i, acc = attend_kv_block(
                q, q_pe, k_buf, v_buf, slots, mask_n, mask_n[None, :], kv_head, stride_kt,
                stride_kh, stride_vt, stride_vh, dk, dpe, dv, scale_log2, m_i, l_i, acc,
                BLOCK_D, BLOCK_DPE, BLOCK_DV, HAS_PE, V_IS_K, True)

        nonempty = l_i > 0
        out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
        lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
        part = (part_out + b.to(tl.int64) * stride_pb + heads[:, None] * stride_ph
                + split * stride_ps + offs_dv[None, :])
        tl.store(part, out, mask=mask_h[:, None] & (offs_dv[None, :] < dv))
        tl.store(part_lse + b.to(tl.int64) * stride_lb + heads * stride_lh + split, lse,
                 mask=mask_h)
        if FUSE_REDUCE:
            tl.debug_barrier()  # every thread's partial is written before the group's count moves
            count = counters + b * tl.num_programs(1) + hb
            if tl.atomic_add(count, 1, sem="acq_rel") == NUM_SPLITS - 1:
                _reduce_splits(part_out, part_lse, out_ptr, b.to(tl.int64), heads, mask_h,
                               stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
                               stride_ob, stride_oh, dv, NUM_SPLITS, BLOCK_DV)
                tl.atomic_xchg(count, 0)  # zero again for the next launch

    @triton.jit
    def _reduce_splits(part_out, part_lse, out_ptr, b, heads, mask_h, stride_pb, stride_ph,
                       stride_ps, stride_lb, stride_lh, stride_ob, stride_oh, dv,
                       NUM_SPLITS: tl.constexpr, BLOCK_DV: tl.constexpr):
        """Stage 2 inside stage 1's launch for rows `heads` of request b: the splits' outputs
        weighted by their sum-exp, read from L2 (.cg), where the other programs' stores are."""
        offs_d = tl.arange(0, BLOCK_DV)
        lse_rows = part_lse + b * stride_lb + heads * stride_lh  # [BLOCK_H]
        m = tl.full(heads.shape, float("-inf"), dtype=tl.float32)
        for s in tl.static_range(NUM_SPLITS):
            m = tl.maximum(m, tl.load(lse_rows + s, mask=mask_h, other=float("-inf"),
                                      cache_modifier=".cg"))
        m = tl.where(m == float("-inf"), 0.0, m)  # every split empty (seq_len 0): output 0
        mask = mask_h[:, None] & (offs_d[None, :] < dv)
        rows = part_out + b * stride_pb + heads[:, None] * stride_ph + offs_d[None, :]
        acc = tl.zeros([heads.shape[0], BLOCK_DV], dtype=tl.float32)
        den = tl.zeros(heads.shape, dtype=tl.float32)
        for s in tl.static_range(NUM_SPLITS):
            lse = tl.load(lse_rows + s, mask=mask_h, other=float("-inf"), cache_modifier=".cg")
            w = tl.exp2(lse - m)  # 0 for empty splits, whose outputs are not read
            part = tl.load(rows + s * stride_ps, mask=mask & (lse > float("-inf"))[:, None],
                           other=0.0, cache_modifier=".cg")
            acc += w[:, None] * part
            den += w
        res = acc / tl.where(den > 0, den, 1.0)[:, None]
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 res.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _decode_reduce_kernel(part_out, part_lse, out_ptr,
                              stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
                              stride_ob, stride_oh, dv,
                              NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
                              BLOCK_DV: tl.constexpr, USE_PDL: tl.constexpr):
        """Stage 2, program (request, head): the splits' outputs weighted by their sum-exp."""
        pdl_wait(USE_PDL)
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, BLOCK_DV)
        mask_s = offs_s < NUM_SPLITS
        lse = tl.load(part_lse + b * stride_lb + h * stride_lh + offs_s, mask=mask_s,
                      other=float("-inf"))  # [BLOCK_S]
        m = tl.max(lse, 0)
        m = tl.where(m == float("-inf"), 0.0, m)  # every split empty (seq_len 0): output 0
        w = tl.exp2(lse - m)  # 0 for empty splits
        parts = tl.load(part_out + b * stride_pb + h * stride_ph + offs_s[:, None] * stride_ps
                        + offs_d[None, :], mask=mask_s[:, None] & (offs_d[None, :] < dv),
                        other=0.0)  # [BLOCK_S, BLOCK_DV]
        den = tl.sum(w, 0)
        res = tl.sum(parts * w[:, None], 0) / tl.where(den > 0, den, 1.0)
        tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d,
                 res.to(out_ptr.dtype.element_ty), mask=offs_d < dv)
