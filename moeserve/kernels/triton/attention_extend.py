"""Triton extend (prefill) attention over the token-slot KV pool, the new tokens already stored.

Query token j of request i sits at absolute position p = prefix_i + j and attends the request's
positions [0, p]: the cached prefix and, causally, the new tokens. Everything is read from the
pool through `req_to_token`, so a prefix hit needs no separate path. The key dim splits into a
main and a rope part and MLA's value is the main part of the K tile, as in attention.py.
"""

from __future__ import annotations

import torch

from moeserve.kernels.triton.attention import LOG2E, block_dim, fit_kv_tile, triton

if triton is not None:
    import triton.language as tl

    from moeserve.kernels.triton.attention import attend_kv_block, load_query


PAD_BLOCK, NO_BLOCK = -1, -2  # block-table request entries: zero-fill padding rows | nothing
ONE_TOKEN = -1  # block-table block entry: a one-token request, its heads packed into the rows


def extend_block_m(dk: int, rows: int | None = None) -> int:
    """Query rows per program: 32 for wide keys (MLA's 512-channel latent) so the tiles fit in
    registers, else `rows` (`attention.extend_block_m`: 64 or 128) or 64.
    Why 128 is offered: at 64 rows each program reads a K/V block (32 KB at D = 128) for 2 MFLOP
    of dots, so the heads' programs of a causal 4096-token prefill need ~12 TB/s of L2 traffic at
    the matmul peak; 128 rows halve that (docs/gpu_decode.md, the prefill section)."""
    if dk > 128:
        return 32
    return 64 if rows is None else rows


def extend_launch(block_m: int) -> tuple[int, int]:
    """(BLOCK_N, num_warps) of the extend kernel for its query rows: a 128-row tile takes two
    warpgroups (each wgmma covers 64 rows)."""
    return {32: (32, 8), 64: (64, 4), 128: (64, 8)}[block_m]


def extend_blocks(extend_lens: list[int], block_m: int) -> tuple[list[int], list[int]]:
    """The extend grid's block table: (request of each block, its query block within that
    request's new tokens), one entry per `block_m` new tokens of each request in order; a
    one-token request (a decode riding in a MIXED step) is one ONE_TOKEN entry, whose programs
    take the query heads of one KV head together, so its K/V is read once per KV head rather
    than once per query head."""
    reqs: list[int] = []
    blocks: list[int] = []
    for i, n in enumerate(extend_lens):
        if n == 1:
            reqs.append(i)
            blocks.append(ONE_TOKEN)
            continue
        nb = -(-n // block_m)
        reqs += [i] * nb
        blocks += range(nb)
    return reqs, blocks


def heads_per_packed_program(group: int, block_m: int) -> int:
    """Query heads a ONE_TOKEN program takes: its KV head's whole group when that fits the
    block's rows, else the largest divisor of the group that does (every head of one program
    shares the KV head)."""
    if group <= block_m:
        return group
    return max(d for d in range(1, block_m + 1) if group % d == 0)


def extend_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor | None,
                     req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                     qo_start: torch.Tensor, prefix_lens: torch.Tensor, blk_req: torch.Tensor,
                     blk_m: torch.Tensor, scale: float, dk: int, dv: int,
                     out: torch.Tensor, block_m: int | None = None,
                     tile: tuple[int, int, int] | None = None, split_causal: bool = False
                     ) -> None:
    """Causal attention of each request's new tokens over its pool KV.

    q: [T, H, Dq] (Dq = dk + dpe; token-major, request i owns rows qo_start[i]:qo_start[i+1]),
    k_buf/v_buf as in `decode_attention` (v_buf None: MLA), prefix_lens: [B] cached tokens,
    out: [T, H, dv]. The grid is (blocks, heads) over the block table (`extend_blocks`, block
    size `extend_block_m(dk)`): entry j is query block blk_m[j] of request blk_req[j]; a
    PAD_BLOCK entry zero-fills rows [blk_m[j], blk_m[j] + block) of out (a CUDA graph's padding
    tokens) and a NO_BLOCK entry does nothing. Heads are the grid's fast axis, so the programs
    of one query block run together and share its K/V through L2. Every size is a tensor shape, so a graph can
    capture it and replay it with other contents. `block_m`: the block table's rows per block
    (default `extend_block_m(dk)`; it must be the size the table was built with). `tile`:
    (BLOCK_N, num_warps, num_stages) instead of `extend_launch`'s (bench.prefill_kernels sweeps
    it); BLOCK_N and the stages still shrink to fit shared memory. `split_causal`: the key blocks
    that every row of a query block sees run without the causal mask (a second loop takes the
    diagonal); off by default: on an H100 it ran slower (docs/gpu_decode.md, 2026-12-06: 4096
    causal tokens of Qwen3's heads 0.710 ms split against 0.478 ms masked at the 64 x 64 tile).
    """
    t, h, dq = q.shape
    nb = blk_req.shape[0]
    if t == 0 or nb == 0:
        return
    hkv = k_buf.shape[1]
    dpe = dq - dk
    v_is_k = v_buf is None
    assert not v_is_k or dv == dk, "MLA: the value is the main part of the key"
    v_buf = k_buf if v_is_k else v_buf
    block_m = extend_block_m(dk) if block_m is None else block_m
    block_n, warps = extend_launch(block_m)
    stages = 2
    if tile is not None:
        block_n, warps, stages = tile
    block_n, stages = fit_kv_tile(q.element_size(), block_m, block_n,
                                  block_dim(dk) + (block_dim(dpe) if dpe > 0 else 0),
                                  block_dim(dv), v_is_k, stages)
    _extend_kernel[(h, nb)](
        q, k_buf, v_buf, out, req_to_token, req_pool_indices, qo_start, prefix_lens,
        blk_req, blk_m, t, h, heads_per_packed_program(h // hkv, block_m), scale * LOG2E, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        req_to_token.stride(0), h // hkv, dk, dpe, dv,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_dim(dk), BLOCK_DPE=block_dim(max(dpe, 1)),
        BLOCK_DV=block_dim(dv), HAS_PE=dpe > 0, V_IS_K=v_is_k, SPLIT_CAUSAL=split_causal,
        num_warps=warps, num_stages=stages,
    )


if triton is not None:

    @triton.jit
    def _extend_kernel(
        q_ptr, k_buf, v_buf, out_ptr, req_to_token, req_pool_indices, qo_start, prefix_lens,
        blk_req, blk_m, num_rows, num_heads, heads_packed, scale_log2, stride_qt, stride_qh, stride_ot, stride_oh,
        stride_kt, stride_kh, stride_vt, stride_vh, stride_rt, group, dk, dpe, dv,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_DPE: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_PE: tl.constexpr,
        V_IS_K: tl.constexpr, SPLIT_CAUSAL: tl.constexpr,
    ):
        """Program (head, block-table entry): BLOCK_M new tokens of one head over KV positions
        [0, prefix + last token of the block], causally masked; float32 online softmax. A
        ONE_TOKEN entry's program h takes heads [h * heads_packed, + heads_packed) of its one
        token instead (rows = heads), and programs past the heads return."""
        h = tl.program_id(0)
        j = tl.program_id(1)
        i = tl.load(blk_req + j)
        m_blk = tl.load(blk_m + j)
        offs_dv = tl.arange(0, BLOCK_DV)
        r = tl.arange(0, BLOCK_M)
        if i < 0:  # PAD_BLOCK: zeros in padding rows [m_blk, m_blk + BLOCK_M); NO_BLOCK: none
            rows = m_blk + r
            ok = rows < tl.where(i == -1, num_rows, 0)
            zero = tl.zeros([BLOCK_M, BLOCK_DV], dtype=out_ptr.dtype.element_ty)
            tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_ot + h * stride_oh
                     + offs_dv[None, :], zero, mask=ok[:, None] & (offs_dv[None, :] < dv))
            return
        q0 = tl.load(qo_start + i).to(tl.int64)
        n_new = (tl.load(qo_start + i + 1) - q0).to(tl.int32)
        packed = m_blk < 0
        head0 = h * heads_packed
        # past the heads (packed), or past this request's new tokens (or it has none)
        if tl.where(packed, head0 >= num_heads, m_blk * BLOCK_M >= n_new):
            return
        prefix = tl.load(prefix_lens + i).to(tl.int32)
        row = tl.load(req_pool_indices + i).to(tl.int64)
        kv_head = tl.where(packed, head0, h) // group

        # rows: (token, head) pairs; BLOCK_M tokens of head h, or one token's packed heads
        offs_m = tl.where(packed, 0, m_blk * BLOCK_M + r)  # token within the new ones
        heads = tl.where(packed, head0 + r, h)
        mask_m = tl.where(packed, (r < heads_packed) & (heads < num_heads), offs_m < n_new)
        q_pos = prefix + offs_m  # [BLOCK_M] absolute positions
        q_rows = q_ptr + (q0 + offs_m)[:, None] * stride_qt + heads[:, None] * stride_qh
        q, q_pe = load_query(q_rows, mask_m, dk, dpe, BLOCK_D, BLOCK_DPE, HAS_PE)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
        # past the block's last token
        kv_end = prefix + tl.where(packed, 1, tl.minimum((m_blk + 1) * BLOCK_M, n_new))
        # SPLIT_CAUSAL: the whole key blocks below every row's position (all but the diagonal
        # and the ragged end) go through a loop without the causal mask
        if SPLIT_CAUSAL:
            full = tl.where(packed, kv_end, prefix + m_blk * BLOCK_M) // BLOCK_N * BLOCK_N
        else:
            full = kv_end * 0
        for n0 in range(0, full, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < full  # all true
            slots = tl.load(req_to_token + row * stride_rt + offs_n)
            m_i, l_i, acc = attend_kv_block(
                q, q_pe, k_buf, v_buf, slots, mask_n, mask_n[None, :], kv_head, stride_kt,
                stride_kh, stride_vt, stride_vh, dk, dpe, dv, scale_log2, m_i, l_i, acc, BLOCK_D,
                BLOCK_DPE, BLOCK_DV, HAS_PE, V_IS_K, False)
        for n0 in range(full, kv_end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < kv_end
            slots = tl.load(req_to_token + row * stride_rt + offs_n, mask=mask_n, other=0)
            # row r sees position 0 in the first block, so m_i is finite from then on
            causal = mask_n[None, :] & (offs_n[None, :] <= q_pos[:, None])
            m_i, l_i, acc = attend_kv_block(
                q, q_pe, k_buf, v_buf, slots, mask_n, causal, kv_head, stride_kt, stride_kh,
                stride_vt, stride_vh, dk, dpe, dv, scale_log2, m_i, l_i, acc, BLOCK_D,
                BLOCK_DPE, BLOCK_DV, HAS_PE, V_IS_K, True)

        res = acc / l_i[:, None]
        o_rows = out_ptr + (q0 + offs_m)[:, None] * stride_ot + heads[:, None] * stride_oh
        tl.store(o_rows + offs_dv[None, :], res.to(out_ptr.dtype.element_ty),
                 mask=mask_m[:, None] & (offs_dv[None, :] < dv))
