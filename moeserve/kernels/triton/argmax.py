"""Greedy sampling's argmax over the vocabulary, in one launch spread over the whole GPU.

Why: torch's argmax reduces a row in one thread block. Over DeepSeek-V3's 129,280 logits that
took 36.8 µs per decode step on an H200 (profiler, batch 1), as much as the step's 7 MLA
attention kernels together; at batch B it is B blocks, one per row, and about as long. Here
programs (row, chunk) each reduce ARGMAX_BLOCK logits to their maximum and its first index,
store the pair and count their arrival (acq_rel, as the FP8 split-K reduction and the router
do); the row's last program to arrive reads the row's pairs back from L2 and writes the index,
then zeroes the row's counter for the next launch.

Semantics are torch.argmax's: the first index of the maximum; a NaN counts as the maximum, so a
row holding one gives its first NaN's index. Values are compared in float32 (exact for bf16 and
fp16 logits). Graph-safe (no host sync); the counters are one per-device buffer of MAX_ROWS,
zero between launches, so launches on a device must run in stream order, as the sampler's do.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

ARGMAX_BLOCK = 4096  # logits per program: 32 programs for a 129k vocabulary
MAX_ROWS = 4096  # rows the counter buffer covers
MAX_CHUNKS = 1024  # chunks per row the last program holds in registers
_BIG = tl.constexpr(2**31 - 1)  # "no index"


@functools.cache
def _counters(device: torch.device) -> torch.Tensor:
    return torch.zeros(MAX_ROWS, dtype=torch.int32, device=device)


def argmax_rows(x: torch.Tensor, block: int = ARGMAX_BLOCK) -> torch.Tensor | None:
    """x [B, V] (float, unit column stride) → [B] int64, torch.argmax(x, -1)'s result; None
    where it does not apply (more than MAX_ROWS rows, V above block * MAX_CHUNKS, an empty
    dimension): the caller runs torch's. `block`: logits per program (a power of two)."""
    if x.dim() != 2 or x.stride(1) != 1 or not x.is_floating_point():
        return None
    b, v = x.shape
    chunks = triton.cdiv(v, block)
    if b == 0 or v == 0 or b > MAX_ROWS or chunks > MAX_CHUNKS:
        return None
    vals = torch.empty((b, chunks), dtype=torch.float32, device=x.device)
    idx = torch.empty((b, chunks), dtype=torch.int32, device=x.device)
    out = torch.empty(b, dtype=torch.int64, device=x.device)
    _argmax_kernel[(b, chunks)](x, vals, idx, out, _counters(x.device), v, x.stride(0),
                                CHUNKS=chunks, BLOCK_C=triton.next_power_of_2(chunks),
                                BLOCK=block, num_warps=8 if block >= 4096 else 4)
    return out


@triton.jit
def _argmax_kernel(x_ptr, vals_ptr, idx_ptr, out_ptr, counters, V, stride_x,
                   CHUNKS: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK: tl.constexpr):
    """Program (row, chunk): the chunk's (max, first index), a NaN's index where it holds one
    (stored with the value NaN); the row's last program picks among the chunks the same way."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + offs, mask=offs < V,
                other=float("-inf")).to(tl.float32)
    is_nan = x != x
    first_nan = tl.min(tl.where(is_nan, offs, _BIG))
    best = tl.max(tl.where(is_nan, float("-inf"), x))
    first_best = tl.min(tl.where(x == best, offs, _BIG))  # padding (-inf) lies past every real one
    nan_here = first_nan < _BIG
    part = row * CHUNKS + chunk
    tl.store(vals_ptr + part, tl.where(nan_here, float("nan"), best))
    tl.store(idx_ptr + part, tl.where(nan_here, first_nan, first_best))
    tl.debug_barrier()  # the pair is written before the count moves
    if tl.atomic_add(counters + row, 1, sem="acq_rel") == CHUNKS - 1:
        c = tl.arange(0, BLOCK_C)
        ok = c < CHUNKS
        vals = tl.load(vals_ptr + row * CHUNKS + c, mask=ok, other=float("-inf"),
                       cache_modifier=".cg")
        idx = tl.load(idx_ptr + row * CHUNKS + c, mask=ok, other=0, cache_modifier=".cg")
        nan_chunk = tl.min(tl.where(vals != vals, c, _BIG))
        top = tl.max(tl.where(vals != vals, float("-inf"), vals))
        pick = tl.where(nan_chunk < _BIG, nan_chunk, tl.min(tl.where(ok & (vals == top), c, _BIG)))
        tl.store(out_ptr + row, tl.sum(tl.where(c == pick, idx, 0)).to(tl.int64))
        tl.atomic_xchg(counters + row, 0)  # zero again for the next launch
