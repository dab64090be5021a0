"""Row movement of the p2p EP backend between peer-mapped buffers: dispatch, combine, reduce.

The three steps of one p2p dispatch + combine, each one kernel on CUDA (Triton) and the same
semantics in torch elsewhere (the CPU tests run the torch path over shared-memory files):

- `dispatch_rows`: every token row goes to block `me` of each rank that owns one of its experts
  (rows no expert of a rank wants are not sent there), plus a meta row (top-k ids | float32
  weight bits) to every rank, so each receiver knows which rows it got; rows t in [T, T_max)
  carry ids -1 and weights 0 (padding).
- `combine_rows`: each received row that this rank's experts touched goes back to its source.
- `reduce_parts`: the source sums, per token, the partial outputs of the ranks its routing named,
  in float32, taking its own part straight from the expert output.

Why kernels: cudaMemcpyAsync into a peer's symmetric-memory mapping measured ~120 µs of host time
per call on H200. Stores from SMs go over NVLink, return at once, read the source once for all
destinations, and skip the rows a peer does not need. Every destination is its own kernel argument
(a tuple), so Triton knows each is 16-byte aligned and issues 16-byte stores (st.global.v4 in the
PTX; compiled without that alignment fact, the same stores came out 2 bytes wide).

`max_programs` bounds the dispatch and combine kernels' grid (each program then loops over rows):
under two-batch overlap they run on the dispatcher's side stream beside the other micro-batch's
kernels, and a bounded grid leaves most SMs to those (None: one program per row, as fast as it
goes when nothing else runs).
"""

from __future__ import annotations

import torch

try:  # optional: only the CUDA image has Triton
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs
    triton = None

NUM_WARPS = 16  # per program; 8 and 32 measured within 2% of 16 for whole 7168-wide bf16 rows
ROW_CHUNK = 8192  # elements of a row per program (a 7168-wide row: one program)


def expert_owner(ids: torch.Tensor, num_experts: int, ep_size: int) -> torch.Tensor:
    """Global expert ids [...] → owning EP rank [...] (-1 stays -1): rank r owns experts
    [r*E/ep, (r+1)*E/ep). The one placement rule of every dispatcher (the kernels below compute
    the same `id // experts_per_rank`); EPLB maps logical ids to physical slots before it."""
    per_rank = num_experts // ep_size
    return torch.where(ids >= 0, torch.div(ids, per_rank, rounding_mode="floor"), -1)


def owner_mask(topk_ids: torch.Tensor, experts_per_rank: int, ep_size: int) -> torch.Tensor:
    """topk_ids [T, K] → [T, ep] bool: rank r owns one of the token's experts (-1: no expert)."""
    owner = expert_owner(topk_ids, experts_per_rank * ep_size, ep_size)
    owner = torch.where(owner >= 0, owner, ep_size)  # -1 → a dummy column, dropped below
    mask = torch.zeros(topk_ids.shape[0], ep_size + 1, dtype=torch.bool, device=topk_ids.device)
    return mask.scatter_(1, owner, True)[:, :ep_size]


def _row_blocks(h: int) -> tuple[int, int]:
    """(BLOCK_H, programs per row) for rows of h elements."""
    block = min(triton.next_power_of_2(h), ROW_CHUNK)
    return block, triton.cdiv(h, block)


def _programs(rows: int, chunks: int, max_programs: int | None) -> int:
    """Programs along the row axis: one per row, or at most max_programs in all (>= 1)."""
    if max_programs is None:
        return rows
    return max(1, min(rows, max_programs // chunks))


def _use_kernel(t: torch.Tensor) -> bool:
    if triton is None or not t.is_cuda:
        return False
    if torch.cuda.current_device() != t.device.index:  # Triton launches on the current device
        raise RuntimeError(f"current CUDA device {torch.cuda.current_device()} is not the "
                           f"tensors' {t.device}: set it in this thread")
    return True


def dispatch_rows(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  dst_x: list[torch.Tensor], dst_meta: list[torch.Tensor], me: int, t_max: int,
                  experts_per_rank: int, max_programs: int | None = None) -> None:
    """x [T, H], topk_ids [T, K], topk_weights [T, K] → for every rank d:
    dst_x[d][me*t_max + t] = x[t] where d owns one of token t's experts (other rows untouched);
    dst_meta[d][me*t_max + t] = ids | weight bits (int32 [2K]) for t < t_max, ids -1 past T."""
    t, k = topk_ids.shape
    row0 = me * t_max
    if _use_kernel(x):
        block, chunks = _row_blocks(x.shape[1])
        _dispatch_kernel[(_programs(t_max, chunks, max_programs), chunks)](
            x, topk_ids, topk_weights, tuple(dst_x), tuple(dst_meta), row0, t, t_max,
            experts_per_rank,
            ME=me, H=x.shape[1], BLOCK_H=block, K=k, BLOCK_K=triton.next_power_of_2(k),
            NUM_DST=len(dst_x), num_warps=NUM_WARPS)
        return
    meta = torch.zeros((t_max, 2 * k), dtype=torch.int32, device=x.device)  # weight 0.0
    meta[:, :k] = -1
    meta[:t, :k] = topk_ids
    meta[:t, k:] = topk_weights.float().view(torch.int32)
    need = owner_mask(topk_ids, experts_per_rank, len(dst_x))  # [T, ep]
    for d, (dx, dm) in enumerate(zip(dst_x, dst_meta)):
        rows = need[:, d].nonzero().squeeze(1)
        dx.index_copy_(0, rows + row0, x.index_select(0, rows).to(dx.dtype))
        dm[row0 : row0 + t_max].copy_(meta)


def received_view(meta: torch.Tensor, first_expert: int,
                  num_local: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Received meta rows [N, 2K] → (ids int64 [N, K] with ids of other ranks' experts set to -1,
    weights float32 [N, K] with those set to 0, tokens per local expert int64 [num_local]): the
    dispatcher's local view in one kernel instead of a dozen small ops (and no atomics piling onto
    a few counters). None where no kernel runs: the caller computes it in torch."""
    if not _use_kernel(meta):
        return None
    n, k = meta.shape[0], meta.shape[1] // 2
    ids = torch.empty((n, k), dtype=torch.int64, device=meta.device)
    weights = torch.empty((n, k), dtype=torch.float32, device=meta.device)
    counts = torch.zeros(num_local, dtype=torch.int64, device=meta.device)
    rows = 64
    _received_view_kernel[(triton.cdiv(n, rows),)](
        meta, ids, weights, counts, n, first_expert, num_local, K=k,
        BLOCK_K=triton.next_power_of_2(k), ROWS=rows,
        BINS=triton.next_power_of_2(num_local + 1), num_warps=4)
    return ids, weights, counts


def combine_rows(y: torch.Tensor, meta: torch.Tensor, dst_y: list[torch.Tensor], me: int,
                 t_max: int, first_expert: int, num_local: int,
                 max_programs: int | None = None) -> None:
    """y [ep*t_max, H] expert outputs by source block, meta [ep*t_max, 2K] as received →
    dst_y[s][me*t_max + t] = y[s*t_max + t] for every source s != me and row t that one of this
    rank's experts [first_expert, first_expert + num_local) processed. Block `me` stays in y."""
    k = meta.shape[1] // 2
    if _use_kernel(y):
        block, chunks = _row_blocks(y.shape[1])
        rows = (len(dst_y) - 1) * t_max
        _combine_kernel[(_programs(rows, chunks, max_programs), chunks)](
            y, meta, tuple(dst_y), t_max, rows, first_expert, num_local, ME=me,
            H=y.shape[1], BLOCK_H=block, K=k, BLOCK_K=triton.next_power_of_2(k),
            NUM_DST=len(dst_y), num_warps=NUM_WARPS)
        return
    ids = meta[:, :k]
    routed = ((ids >= first_expert) & (ids < first_expert + num_local)).any(1)  # [ep*t_max]
    for s, dy in enumerate(dst_y):
        if s == me:
            continue
        rows = routed[s * t_max : (s + 1) * t_max].nonzero().squeeze(1)
        dy.index_copy_(0, rows + me * t_max, y.index_select(0, rows + s * t_max).to(dy.dtype))


def reduce_parts(parts: torch.Tensor, own: torch.Tensor, topk_ids: torch.Tensor, me: int,
                 experts_per_rank: int, out_dtype: torch.dtype) -> torch.Tensor:
    """parts [ep, t_max, H] (block r from rank r), own [T, H] (this rank's own expert outputs),
    topk_ids [T, K] → [T, H] out_dtype: sum over the ranks owning one of token t's experts of that
    rank's part (own for r == me), accumulated in float32. Blocks of other ranks are read only
    where the routing says they were written."""
    ep, t = parts.shape[0], topk_ids.shape[0]
    h = parts.shape[2]
    out = torch.empty((t, h), dtype=out_dtype, device=parts.device)
    if t == 0:
        return out
    if _use_kernel(parts):
        block, chunks = _row_blocks(h)
        _reduce_kernel[(t, chunks)](
            parts, own, topk_ids, out, parts.shape[1], experts_per_rank, me=me, H=h,
            BLOCK_H=block, K=topk_ids.shape[1],
            BLOCK_K=triton.next_power_of_2(topk_ids.shape[1]), EP=ep, num_warps=NUM_WARPS)
        return out
    need = owner_mask(topk_ids, experts_per_rank, ep)  # [T, ep]
    acc = torch.zeros((t, h), dtype=torch.float32, device=parts.device)
    for r in range(ep):  # the kernel's order, so that both round alike
        part = own if r == me else parts[r, :t]
        acc += torch.where(need[:, r, None], part.float(), 0.0)
    return out.copy_(acc)


if triton is not None:

    @triton.jit
    def _owned_by(ids, d, experts_per_rank):
        """Whether rank d owns one of the ids (a K-vector; -1 is no expert)."""
        hit = (ids >= 0) & (ids // experts_per_rank == d)
        return tl.max(hit.to(tl.int32), axis=0) > 0

    @triton.jit
    def _dispatch_kernel(x, ids_ptr, w_ptr, dst_x, dst_meta, row0, t, t_max, experts_per_rank,
                         ME: tl.constexpr, H: tl.constexpr, BLOCK_H: tl.constexpr, K: tl.constexpr,
                         BLOCK_K: tl.constexpr, NUM_DST: tl.constexpr):
        first_chunk = tl.program_id(1) == 0  # writes the meta row
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        ks = tl.arange(0, BLOCK_K)
        kmask = ks < K
        # NOTE: a vector, not kmask & first_chunk: Triton's interpreter rejects that mask dtype
        meta_mask = kmask & ((ks * 0 + tl.program_id(1)) == 0)
        for row in range(tl.program_id(0), t_max, tl.num_programs(0)):  # grid-stride over rows
            dst_row = tl.cast(row0 + row, tl.int64)
            if row < t:
                ids = tl.load(ids_ptr + row * K + ks, mask=kmask, other=-1)
                w = tl.load(w_ptr + row * K + ks, mask=kmask, other=0.0)
                w = w.to(tl.float32).to(tl.int32, bitcast=True)
                v = tl.load(x + tl.cast(row, tl.int64) * H + cols, mask=cols < H)
                for i in tl.static_range(1, NUM_DST + 1):  # rank ME+1 first, ME's own buffer last
                    meta_d = dst_meta[(ME + i) % NUM_DST]
                    x_d = dst_x[(ME + i) % NUM_DST]
                    tl.store(meta_d + dst_row * 2 * K + ks, ids.to(tl.int32), mask=meta_mask)
                    tl.store(meta_d + dst_row * 2 * K + K + ks, w, mask=meta_mask)
                    if _owned_by(ids, (ME + i) % NUM_DST, experts_per_rank):
                        tl.store(x_d + dst_row * H + cols, v.to(x_d.dtype.element_ty),
                                 mask=cols < H)
            elif first_chunk:
                for d in tl.static_range(NUM_DST):
                    tl.store(dst_meta[d] + dst_row * 2 * K + ks,
                             tl.full((BLOCK_K,), -1, tl.int32), mask=kmask)
                    tl.store(dst_meta[d] + dst_row * 2 * K + K + ks,
                             tl.zeros((BLOCK_K,), tl.int32), mask=kmask)

    @triton.jit
    def _combine_kernel(y, meta, dst_y, t_max, rows, first_expert, num_local, ME: tl.constexpr,
                        H: tl.constexpr, BLOCK_H: tl.constexpr, K: tl.constexpr,
                        BLOCK_K: tl.constexpr, NUM_DST: tl.constexpr):
        # work item p takes row t = p // (ep-1) of the (p % (ep-1))-th other rank after ME:
        # consecutive items write to different ranks, so all links carry traffic at once (block
        # by block, every rank would first write into rank 0, then into rank 1, ...)
        ks = tl.arange(0, BLOCK_K)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        for p in range(tl.program_id(0), rows, tl.num_programs(0)):  # rows = (ep - 1) * t_max
            src_rank = (ME + 1 + p % (NUM_DST - 1)) % NUM_DST
            t = p // (NUM_DST - 1)
            row = src_rank * t_max + t
            ids = tl.load(meta + tl.cast(row, tl.int64) * 2 * K + ks, mask=ks < K, other=-1)
            hit = (ids >= first_expert) & (ids < first_expert + num_local)
            if tl.max(hit.to(tl.int32), axis=0) > 0:
                v = tl.load(y + tl.cast(row, tl.int64) * H + cols, mask=cols < H)
                dst_row = tl.cast(ME * t_max + t, tl.int64)
                for s in tl.static_range(NUM_DST):
                    if (s != ME) & (src_rank == s):
                        tl.store(dst_y[s] + dst_row * H + cols, v.to(dst_y[s].dtype.element_ty),
                                 mask=cols < H)

    @triton.jit
    def _reduce_kernel(parts, own, ids_ptr, out, t_max, experts_per_rank, me: tl.constexpr,
                       H: tl.constexpr, BLOCK_H: tl.constexpr, K: tl.constexpr,
                       BLOCK_K: tl.constexpr, EP: tl.constexpr):
        row = tl.program_id(0)  # < T
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        ks = tl.arange(0, BLOCK_K)
        ids = tl.load(ids_ptr + row * K + ks, mask=ks < K, other=-1)
        acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
        for r in tl.static_range(EP):
            if _owned_by(ids, r, experts_per_rank):
                if r == me:
                    src = own + row.to(tl.int64) * H
                else:
                    src = parts + (r * t_max + row).to(tl.int64) * H
                acc += tl.load(src + cols, mask=cols < H).to(tl.float32)
        tl.store(out + row.to(tl.int64) * H + cols, acc.to(out.dtype.element_ty), mask=cols < H)

    @triton.jit
    def _received_view_kernel(meta, ids_out, w_out, counts, n, first_expert, num_local,
                              K: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr,
                              BINS: tl.constexpr):
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        ks = tl.arange(0, BLOCK_K)
        mask = (rows[:, None] < n) & (ks[None, :] < K)
        at = rows[:, None].to(tl.int64) * 2 * K + ks[None, :]
        ids = tl.load(meta + at, mask=mask, other=-1)
        w = tl.load(meta + at + K, mask=mask, other=0).to(tl.float32, bitcast=True)
        local = (ids >= first_expert) & (ids < first_expert + num_local)
        out_at = rows[:, None].to(tl.int64) * K + ks[None, :]
        tl.store(ids_out + out_at, tl.where(local, ids, -1).to(tl.int64), mask=mask)
        tl.store(w_out + out_at, tl.where(local, w, 0.0), mask=mask)
        slot = tl.where(local, ids - first_expert, num_local)  # non-local: the spare last bin
        hist = tl.histogram(tl.reshape(slot, (ROWS * BLOCK_K,)), BINS)
        bins = tl.arange(0, BINS)
        tl.atomic_add(counts + bins, hist.to(tl.int64), mask=bins < num_local)
