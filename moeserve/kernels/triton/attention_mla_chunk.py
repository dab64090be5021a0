"""Triton attention of MLA's MHA form over one piece of decompressed K/V (attention/mla_mha.py).

A piece holds the decompressed keys and values of a run of KV positions of the step's requests:
kv [n, H, nope + v] (k_nope | v per head, kv_b_proj's output), k_pe [n, r] (shared by the heads).
Segment s of the piece is request seg_req[s]'s positions [seg_pos0[s], + seg_len[s]) at rows
[seg_kv0[s], + seg_len[s]). The grid is (heads, block-table entries); entry j is query block
blk_m[j] (BLOCK_M rows of the request's new tokens) against segment blk_seg[j], causally
masked by absolute position. The piece's result merges into the running (out, lse) of earlier
pieces through the log2-sum-exp, or, when the step has a single piece, is written as the output.
"""

from __future__ import annotations

import torch

from moeserve.kernels.triton.attention import LOG2E, block_dim, fit_kv_tile, triton

if triton is not None:
    import triton.language as tl

MLA_CHUNK_BLOCK_M = 64  # query rows per program (the plan's block table uses the same)


def mla_chunk_attention(q: torch.Tensor, kv: torch.Tensor, k_pe: torch.Tensor,
                        meta: torch.Tensor, num_segs: int, num_blocks: int,
                        qo_start: torch.Tensor, prefix_lens: torch.Tensor, out: torch.Tensor,
                        lse: torch.Tensor, scale: float, single: bool) -> None:
    """q: [T, H, nope + r], kv: [n, H, nope + v] (rows may be strided), k_pe: [n, r], meta:
    int32 seg_req | seg_pos0 | seg_kv0 | seg_len (num_segs each) | blk_seg | blk_m (num_blocks
    each), qo_start [B + 1], prefix_lens [B]. out: [T, H, v], in q's dtype when `single` (the
    result), else float32 accumulators merged with lse [T, H] (log2 domain, -inf: nothing yet)."""
    if num_blocks == 0:
        return
    t, h, dq = q.shape
    r = k_pe.shape[-1]
    nope = dq - r
    dv = kv.shape[-1] - nope
    assert q.stride(-1) == 1 and kv.stride(-1) == 1 and k_pe.stride(-1) == 1
    bd, bpe, bv = block_dim(nope), block_dim(r), block_dim(dv)
    block_n, stages = fit_kv_tile(q.element_size(), MLA_CHUNK_BLOCK_M, 64, bd + bpe, bv, False, 2)
    _mla_chunk_kernel[(h, num_blocks)](
        q, kv, k_pe, out, lse, meta, qo_start, prefix_lens, num_segs, num_blocks,
        scale * LOG2E, q.stride(0), q.stride(1), kv.stride(0), kv.stride(1), k_pe.stride(0),
        out.stride(0), out.stride(1), lse.stride(0), nope, r, dv,
        BLOCK_M=MLA_CHUNK_BLOCK_M, BLOCK_N=block_n, BLOCK_D=bd, BLOCK_PE=bpe, BLOCK_V=bv,
        SINGLE=single, num_warps=4, num_stages=stages)


if triton is not None:

    @triton.jit
    def _mla_chunk_kernel(q_ptr, kv_ptr, pe_ptr, out_ptr, lse_ptr, meta, qo_start, prefix_lens,
                          num_segs, num_blocks, scale_log2, stride_qt, stride_qh, stride_kt,
                          stride_kh, stride_pt, stride_ot, stride_oh, stride_lt, nope, r, dv,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                          BLOCK_PE: tl.constexpr, BLOCK_V: tl.constexpr, SINGLE: tl.constexpr):
        """Program (head, entry): BLOCK_M queries of one head over one segment; float32 online
        softmax in base 2, then the merge with the earlier pieces' partial result."""
        h = tl.program_id(0)
        j = tl.program_id(1)
        seg = tl.load(meta + 4 * num_segs + j)
        mb = tl.load(meta + 4 * num_segs + num_blocks + j)
        i = tl.load(meta + seg)
        pos0 = tl.load(meta + num_segs + seg)
        kv0 = tl.load(meta + 2 * num_segs + seg).to(tl.int64)
        n = tl.load(meta + 3 * num_segs + seg)
        q0 = tl.load(qo_start + i).to(tl.int64)
        e = tl.load(qo_start + i + 1) - tl.load(qo_start + i)
        p = tl.load(prefix_lens + i)

        offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = offs_m < e
        q_pos = p + offs_m
        offs_d = tl.arange(0, BLOCK_D)
        offs_pe = tl.arange(0, BLOCK_PE)
        offs_v = tl.arange(0, BLOCK_V)
        q_rows = q_ptr + (q0 + offs_m)[:, None] * stride_qt + h * stride_qh
        q = tl.load(q_rows + offs_d[None, :], mask=mask_m[:, None] & (offs_d[None, :] < nope),
                    other=0.0)
        q_pe = tl.load(q_rows + nope + offs_pe[None, :],
                       mask=mask_m[:, None] & (offs_pe[None, :] < r), other=0.0)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_V], dtype=tl.float32)
        # keys up to the block's last query position
        last = p + tl.minimum((mb + 1) * BLOCK_M, e) - 1
        end = tl.minimum(n, last - pos0 + 1)
        for n0 in range(0, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < end
            rows = (kv0 + offs_n)[:, None]
            k = tl.load(kv_ptr + rows * stride_kt + h * stride_kh + offs_d[None, :],
                        mask=mask_n[:, None] & (offs_d[None, :] < nope), other=0.0)
            k_pe = tl.load(pe_ptr + rows * stride_pt + offs_pe[None, :],
                           mask=mask_n[:, None] & (offs_pe[None, :] < r), other=0.0)
            qk = tl.dot(q, tl.trans(k)) + tl.dot(q_pe, tl.trans(k_pe))
            keep = mask_n[None, :] & ((pos0 + offs_n)[None, :] <= q_pos[:, None])
            qk = tl.where(keep, qk * scale_log2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet
            alpha = tl.exp2(m_i - m_safe)
            pr = tl.exp2(qk - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(pr, 1)
            v = tl.load(kv_ptr + rows * stride_kt + h * stride_kh + nope + offs_v[None, :],
                        mask=mask_n[:, None] & (offs_v[None, :] < dv), other=0.0)
            acc = acc * alpha[:, None] + tl.dot(pr.to(v.dtype), v)
            m_i = m_new

        seen = l_i > 0
        o = acc / tl.where(seen, l_i, 1.0)[:, None]
        o_rows = out_ptr + (q0 + offs_m)[:, None] * stride_ot + h * stride_oh + offs_v[None, :]
        omask = mask_m[:, None] & (offs_v[None, :] < dv)
        if SINGLE:
            tl.store(o_rows, o.to(out_ptr.dtype.element_ty), mask=omask)
        else:
            lse_new = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
            l_rows = lse_ptr + (q0 + offs_m) * stride_lt + h
            lse_old = tl.load(l_rows, mask=mask_m, other=float("-inf"))
            top = tl.maximum(lse_old, lse_new)
            top = tl.where(top == float("-inf"), 0.0, top)
            wa = tl.exp2(lse_old - top)
            wb = tl.exp2(lse_new - top)
            tot = wa + wb
            o_old = tl.load(o_rows, mask=omask, other=0.0)
            merged = (o_old * wa[:, None] + o * wb[:, None]) / tl.where(tot > 0, tot, 1.0)[:, None]
            tl.store(o_rows, merged, mask=omask & seen[:, None])
            tl.store(l_rows, top + tl.log2(tl.where(tot > 0, tot, 1.0)), mask=mask_m & seen)
