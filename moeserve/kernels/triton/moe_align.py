"""Sorting token -> expert pairs into expert blocks for the fused MoE's grouped GEMMs
(`moe_align_block_size`): one single-program kernel for decode batches, a parallel count / layout
/ scatter for large ones, a parallel one-token kernel for batch 1, and the torch reference.

Everything is sized from T*K, E_local and BLOCK_SIZE_M and never waits on the host, so it can be
captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeserve.kernels.triton.pdl import launch_kwargs, pdl_wait
from moeserve.kernels.slot_counts import count_per_expert

# Up to this many pairs one single-program kernel sorts them (one launch for decode); above it
# three parallel kernels count, lay out and scatter them (`_align_parallel`).
TRITON_ALIGN_MAX_PAIRS = 1024
ALIGN_CHUNK = 256  # pairs per program of the parallel align kernels


def max_padded_pairs(num_pairs: int, num_local: int, block_m: int) -> int:
    """Rows of the sorted layout: at most min(pairs, experts) experts are touched, each padded by
    fewer than block_m rows; rounded up to whole blocks."""
    bound = num_pairs + min(num_pairs, num_local) * (block_m - 1)
    return triton.cdiv(bound, block_m) * block_m


def moe_align_block_size(topk_ids: torch.Tensor, block_m: int, first_expert: int,
                         num_local: int, pdl: bool = False
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [T, K] global ids → (sorted_ids int32 [P], expert_ids int32 [P / block_m],
    num_tokens_post_padded int32 [1]), P = `max_padded_pairs`.

    sorted_ids lists local pairs expert by expert (stable within an expert), each expert's run
    padded to a multiple of block_m with T*K (no pair); non-local pairs appear nowhere. Block b
    belongs to expert_ids[b], -1 past num_tokens_post_padded (whose rows are all padding).

    One token (batch-1 decode) whose K distinct experts all fit: block k holds pair k alone, in
    pair order, with expert -1 where that expert is not local (`_align_one_token`: a parallel
    kernel; the sorting one ran ~7 µs there, ×48 layers of a batch-1 step). `pdl`: those two
    single-launch paths as programmatic dependent launches (pdl.py)."""
    topk_ids, n = topk_ids.contiguous(), topk_ids.numel()
    p = max_padded_pairs(n, num_local, block_m)
    if topk_ids.shape[0] == 1 and p == n * block_m:
        return _align_one_token(topk_ids, block_m, first_expert, num_local, pdl)
    if n <= TRITON_ALIGN_MAX_PAIRS:
        return _align_triton(topk_ids, block_m, first_expert, num_local, p, pdl)
    return _align_parallel(topk_ids, block_m, first_expert, num_local, p)


def _align_parallel(topk_ids, block_m, first_expert, num_local, p):
    """Count (per-program histograms, one atomic per expert), lay the runs out (offsets, block
    owners, padding; programs by block), scatter (an atomic cursor per expert): 3 launches where the
    torch ops took ~20 (an extend step of 2048 tokens spent ~110 µs a layer in them). Within an
    expert the pairs land in any order: each GEMM row depends on its own pair only, so the
    results are the same."""
    n, dev = topk_ids.numel(), topk_ids.device
    sorted_ids = torch.empty(p, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(p // block_m, dtype=torch.int32, device=dev)
    num_post = torch.empty(1, dtype=torch.int32, device=dev)
    counts = torch.zeros(num_local, dtype=torch.int32, device=dev)
    cursor = torch.empty(num_local, dtype=torch.int32, device=dev)
    block_e = max(16, triton.next_power_of_2(num_local))
    grid = (triton.cdiv(n, ALIGN_CHUNK),)
    _align_count_kernel[grid](topk_ids, counts, n, first_expert, num_local, BLOCK_E=block_e,
                              CHUNK=ALIGN_CHUNK)
    num_blocks = p // block_m
    chunk_b = max(16, 2048 // block_m)
    _align_layout_kernel[(triton.cdiv(num_blocks, chunk_b),)](
        counts, cursor, sorted_ids, expert_ids, num_post, n, num_local, num_blocks,
        BLOCK_M=block_m, BLOCK_E=block_e, CHUNK_B=chunk_b)
    _align_scatter_kernel[grid](topk_ids, cursor, sorted_ids, n, first_expert, num_local,
                                CHUNK=ALIGN_CHUNK)
    return sorted_ids, expert_ids, num_post


@triton.jit(do_not_specialize=["num_pairs"])
def _align_count_kernel(ids_ptr, counts_ptr, num_pairs, first_expert, num_local,
                        BLOCK_E: tl.constexpr, CHUNK: tl.constexpr):
    pairs = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    experts = tl.arange(0, BLOCK_E)
    hot = _local_one_hot(ids_ptr, pairs, num_pairs, first_expert, num_local, experts)
    tl.atomic_add(counts_ptr + experts, tl.sum(hot, axis=1), mask=experts < num_local)


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def _align_layout_kernel(counts_ptr, cursor_ptr, sorted_ptr, expert_ptr, num_post_ptr, num_pairs,
                         num_local, num_blocks, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
                         CHUNK_B: tl.constexpr):
    """Runs padded to whole blocks. Program i owns blocks [i * CHUNK_B, (i + 1) * CHUNK_B): each
    recomputes the runs from the E counts (cheap) and writes its blocks' owners and every slot of
    them that no pair takes (num_pairs, as in `_align_kernel`); program 0 also writes num_post
    and cursor = each run's start (the scatter advances it). One program walking every block
    took most of the align's time at 4096 x 8 pairs (docs/gpu_decode.md)."""
    experts = tl.arange(0, BLOCK_E)
    local = experts < num_local
    counts = tl.load(counts_ptr + experts, mask=local, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    total = tl.sum(padded, axis=0)
    if tl.program_id(0) == 0:
        tl.store(num_post_ptr, total)
        tl.store(cursor_ptr + experts, starts, mask=local)
    blocks = tl.program_id(0) * CHUNK_B + tl.arange(0, CHUNK_B)
    first_row = blocks * BLOCK_M
    before = (ends[None, :] <= first_row[:, None]) & local[None, :]  # [CHUNK_B, E]
    owner = tl.where(first_row < total, tl.sum(before.to(tl.int32), axis=1), -1)
    in_range = blocks < num_blocks
    tl.store(expert_ptr + blocks, owner, mask=in_range)
    # the owner's first free row (its pairs fill the rows before it); unused blocks: row 0
    mine = (experts[None, :] == owner[:, None]).to(tl.int32)
    fill = tl.sum(mine * (starts + counts)[None, :], axis=1) - first_row
    rows = tl.arange(0, BLOCK_M)
    pad = (rows[None, :] >= fill[:, None]) & in_range[:, None]
    tl.store(sorted_ptr + first_row[:, None] + rows[None, :], num_pairs, mask=pad)


@triton.jit(do_not_specialize=["num_pairs"])
def _align_scatter_kernel(ids_ptr, cursor_ptr, sorted_ptr, num_pairs, first_expert, num_local,
                          CHUNK: tl.constexpr):
    pairs = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    ok = pairs < num_pairs
    local = tl.load(ids_ptr + pairs, mask=ok, other=0) - first_expert
    ok = ok & (local >= 0) & (local < num_local)
    dest = tl.atomic_add(cursor_ptr + local, 1, mask=ok)
    tl.store(sorted_ptr + dest, pairs, mask=ok)


def _align_triton(topk_ids, block_m, first_expert, num_local, p, pdl=False):
    n, dev = topk_ids.numel(), topk_ids.device
    sorted_ids = torch.empty(p, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(p // block_m, dtype=torch.int32, device=dev)
    num_post = torch.empty(1, dtype=torch.int32, device=dev)
    block_e = max(16, triton.next_power_of_2(num_local))
    chunk = max(16, min(triton.next_power_of_2(n), 8192 // block_e))
    _align_kernel[(1,)](topk_ids, sorted_ids, expert_ids, num_post, n, first_expert, num_local,
                        p // block_m, BLOCK_M=block_m, BLOCK_E=block_e, CHUNK=chunk,
                        CHUNK_B=max(16, 2048 // block_m), num_warps=8 if chunk * block_e > 4096
                        else 4, **launch_kwargs(pdl))
    return sorted_ids, expert_ids, num_post


def _align_one_token(topk_ids, block_m, first_expert, num_local, pdl=False):
    k, dev = topk_ids.numel(), topk_ids.device
    sorted_ids = torch.empty(k * block_m, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(k, dtype=torch.int32, device=dev)
    num_post = torch.empty(1, dtype=torch.int32, device=dev)
    _align_one_token_kernel[(1,)](topk_ids, sorted_ids, expert_ids, num_post, first_expert,
                                  num_local, K=k, BLOCK_K=max(16, triton.next_power_of_2(k)),
                                  BLOCK_M=block_m, **launch_kwargs(pdl))
    return sorted_ids, expert_ids, num_post


@triton.jit
def _align_one_token_kernel(ids_ptr, sorted_ptr, expert_ptr, num_post_ptr, first_expert,
                            num_local, K: tl.constexpr, BLOCK_K: tl.constexpr,
                            BLOCK_M: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_wait(USE_PDL)
    kk = tl.arange(0, BLOCK_K)
    ok = kk < K
    local = tl.load(ids_ptr + kk, mask=ok, other=0) - first_expert
    is_local = (local >= 0) & (local < num_local)
    tl.store(expert_ptr + kk, tl.where(is_local, local, -1).to(tl.int32), mask=ok)
    rows = tl.arange(0, BLOCK_M)
    vals = tl.where(rows[None, :] == 0, kk[:, None], K)  # [BK, BM]: the pair, then padding
    tl.store(sorted_ptr + kk[:, None] * BLOCK_M + rows[None, :], vals.to(tl.int32),
             mask=ok[:, None])
    tl.store(num_post_ptr, K * BLOCK_M)


def _align_torch(topk_ids, block_m, first_expert, num_local, p):
    n, dev = topk_ids.numel(), topk_ids.device
    local = topk_ids.flatten().long() - first_expert  # [T*K]
    key = torch.where((local >= 0) & (local < num_local), local, num_local)  # num_local: dropped
    counts = count_per_expert(key, num_local)  # [E]
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)  # [E] padded run ends
    order = key.argsort(stable=True)  # [T*K] pairs grouped by expert
    skey = key[order]
    e = skey.clamp(max=num_local - 1)
    rank = torch.arange(n, device=dev) - (counts.cumsum(0) - counts)[e]  # place within its expert
    dest = torch.where(skey < num_local, (ends - padded)[e] + rank, p)  # p: a spare slot
    sorted_ids = torch.full((p + 1,), n, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    block_start = torch.arange(0, p, block_m, device=dev)  # [P / block_m]
    owner = torch.searchsorted(ends, block_start, right=True)
    expert_ids = torch.where(owner < num_local, owner, -1).to(torch.int32)
    return sorted_ids[:p], expert_ids, ends[-1:].to(torch.int32)


@triton.jit
def _local_one_hot(ids_ptr, pairs, num_pairs, first_expert, num_local, experts):
    """[BLOCK_E, CHUNK] int32: 1 where pair `pairs[j]` goes to local expert `experts[i]` (pairs on
    the last axis, so the scan over them is along the fastest-varying one)."""
    ok = pairs < num_pairs
    local = tl.load(ids_ptr + pairs, mask=ok, other=0) - first_expert
    hit = (experts[:, None] == local[None, :]) & ok[None, :] & (experts < num_local)[:, None]
    return hit.to(tl.int32)


# NOTE: sizes that change with the batch are not specialized on (divisibility by 16, == 1):
# otherwise each new batch size could compile another variant.
@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def _align_kernel(ids_ptr, sorted_ptr, expert_ptr, num_post_ptr, num_pairs, first_expert,
                  num_local, num_blocks, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
                  CHUNK: tl.constexpr, CHUNK_B: tl.constexpr, USE_PDL: tl.constexpr):
    # NOTE: one program; every output element is written exactly once (no ordering between
    # threads is needed): padding, unused blocks and pair slots are disjoint.
    pdl_wait(USE_PDL)
    experts = tl.arange(0, BLOCK_E)
    lanes = tl.arange(0, CHUNK)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):
        hot = _local_one_hot(ids_ptr, start + lanes, num_pairs, first_expert, num_local, experts)
        counts += tl.sum(hot, axis=1)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)  # [E]
    starts = ends - padded
    total = tl.sum(padded, axis=0)
    tl.store(num_post_ptr, total)
    rows = tl.arange(0, BLOCK_M)
    pos = (starts + counts)[:, None] + rows[None, :]  # [E, BLOCK_M] each run's padding
    tl.store(sorted_ptr + pos, num_pairs, mask=pos < ends[:, None])
    for b0 in range(0, num_blocks, CHUNK_B):
        blocks = b0 + tl.arange(0, CHUNK_B)
        first_row = blocks * BLOCK_M
        before = (ends[None, :] <= first_row[:, None]) & (experts < num_local)[None, :]
        owner = tl.where(first_row < total, tl.sum(before.to(tl.int32), axis=1), -1)
        tl.store(expert_ptr + blocks, owner, mask=blocks < num_blocks)
        unused = (owner < 0) & (blocks < num_blocks)
        tl.store(sorted_ptr + first_row[:, None] + rows[None, :], num_pairs, mask=unused[:, None])
    seen = tl.zeros([BLOCK_E], dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):
        pairs = start + lanes
        hot = _local_one_hot(ids_ptr, pairs, num_pairs, first_expert, num_local, experts)
        slot = (starts + seen)[:, None] + tl.cumsum(hot, axis=1) - hot  # [E, CHUNK]
        dest = tl.sum(hot * slot, axis=0)
        tl.store(sorted_ptr + dest, pairs, mask=tl.sum(hot, axis=0) > 0)
        seen += tl.sum(hot, axis=1)
