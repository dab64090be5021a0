"""Triton extend (prefill) attention over the token-slot KV pool, the new tokens already stored.

Query token j of request i sits at absolute position p = prefix_i + j and attends the request's
positions [0, p]: the cached prefix and, causally, the new tokens. Everything is read from the
pool through `req_to_token`, so a prefix hit needs no separate path. The key dim splits into a
main and a rope part and MLA's value is the main part of the K tile, as in triton_attention.py.
"""

from __future__ import annotations

import torch

from moeserve.kernels.triton_attention import LOG2E, block_dim, triton

if triton is not None:
    import triton.language as tl

    from moeserve.kernels.triton_attention import attend_kv_block, load_query


def extend_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor | None,
                     req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                     qo_start: torch.Tensor, prefix_lens: torch.Tensor, max_new: int,
                     scale: float, dk: int, dv: int, out: torch.Tensor) -> None:
    """Causal attention of each request's new tokens over its pool KV.

    q: [T, H, Dq] (Dq = dk + dpe; token-major, request i owns rows qo_start[i]:qo_start[i+1]),
    k_buf/v_buf as in `decode_attention` (v_buf None: MLA), prefix_lens: [B] cached tokens,
    max_new: the largest new-token count (host int: sizes the grid), out: [T, H, dv].
    """
    t, h, dq = q.shape
    b = req_pool_indices.shape[0]
    if t == 0 or b == 0 or max_new == 0:
        return
    hkv = k_buf.shape[1]
    dpe = dq - dk
    v_is_k = v_buf is None
    assert not v_is_k or dv == dk, "MLA: the value is the main part of the key"
    v_buf = k_buf if v_is_k else v_buf
    big = dk > 128
    block_m, block_n, warps = (32, 32, 8) if big else (64, 64, 4)
    grid = (b, triton.cdiv(max_new, block_m), h)
    _extend_kernel[grid](
        q, k_buf, v_buf, out, req_to_token, req_pool_indices, qo_start, prefix_lens,
        scale * LOG2E, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        req_to_token.stride(0), h // hkv, dk, dpe, dv,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_dim(dk), BLOCK_DPE=block_dim(max(dpe, 1)),
        BLOCK_DV=block_dim(dv), HAS_PE=dpe > 0, V_IS_K=v_is_k, num_warps=warps, num_stages=2,
    )


if triton is not None:

    @triton.jit
    def _extend_kernel(
        q_ptr, k_buf, v_buf, out_ptr, req_to_token, req_pool_indices, qo_start, prefix_lens,
        scale_log2, stride_qt, stride_qh, stride_ot, stride_oh,
        stride_kt, stride_kh, stride_vt, stride_vh, stride_rt, group, dk, dpe, dv,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_DPE: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_PE: tl.constexpr,
        V_IS_K: tl.constexpr,
    ):
        """Program (request, query block, head): BLOCK_M new tokens of one head over KV positions
        [0, prefix + last token of the block], causally masked; float32 online softmax."""
        i = tl.program_id(0)
        m_blk = tl.program_id(1)
        h = tl.program_id(2)
        q0 = tl.load(qo_start + i).to(tl.int64)
        n_new = (tl.load(qo_start + i + 1) - q0).to(tl.int32)
        if m_blk * BLOCK_M >= n_new:  # past this request's new tokens (or it has none)
            return
        prefix = tl.load(prefix_lens + i).to(tl.int32)
        row = tl.load(req_pool_indices + i).to(tl.int64)
        kv_head = h // group

        offs_m = m_blk * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = offs_m < n_new
        q_pos = prefix + offs_m  # [BLOCK_M] absolute positions
        q_rows = q_ptr + (q0 + offs_m)[:, None] * stride_qt + h * stride_qh
        q, q_pe = load_query(q_rows, mask_m, dk, dpe, BLOCK_D, BLOCK_DPE, HAS_PE)
        offs_dv = tl.arange(0, BLOCK_DV)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
        kv_end = prefix + tl.minimum((m_blk + 1) * BLOCK_M, n_new)  # past the block's last token
        for n0 in range(0, kv_end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < kv_end
            slots = tl.load(req_to_token + row * stride_rt + offs_n, mask=mask_n, other=0)
            # row r sees position 0 in the first block, so m_i is finite from then on
            causal = mask_n[None, :] & (offs_n[None, :] <= q_pos[:, None])
            m_i, l_i, acc = attend_kv_block(
                q, q_pe, k_buf, v_buf, slots, mask_n, causal, kv_head, stride_kt, stride_kh,
                stride_vt, stride_vh, dk, dpe, dv, scale_log2, m_i, l_i, acc, BLOCK_D,
                BLOCK_DPE, BLOCK_DV, HAS_PE, V_IS_K)

        res = acc / l_i[:, None]
        o_rows = out_ptr + (q0 + offs_m)[:, None] * stride_ot + h * stride_oh
        tl.store(o_rows + offs_dv[None, :], res.to(out_ptr.dtype.element_ty),
                 mask=mask_m[:, None] & (offs_dv[None, :] < dv))
