"""The EPLB recorder's per-layer count as one Triton kernel (`count_routed`).

Why: the recorder's torch form (cast, mask the ids, index arithmetic on the ring slot, the row
mask times the on/off switch, expand, scatter_add) is a run of small kernels per MoE layer (the
profile of a captured batch-256 Qwen3-30B-A3B step showed ~10 elementwise kernels and a scatter
a layer), and a captured decode graph replays them on every step whether recording is on or
not. Here one launch reads the switch and returns at once when it is off.

Counts are int64 atomic adds, so the result does not depend on their order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeserve.kernels.triton.pdl import launch_kwargs, pdl_wait

MAX_BLOCK = 1024  # pairs per program


def count_routed(ids: torch.Tensor, buf: torch.Tensor, slot: torch.Tensor, on: torch.Tensor,
                 layer_id: int, num_layers: int, rows: torch.Tensor | None = None,
                 pdl: bool = False) -> None:
    """buf[slot, layer_id, id] += rows[t] for every pair (t, k) with id = ids[t, k] (ids < 0 go
    to the spare last column), only while on[0] != 0.

    ids [T, K] (or [T]) integer; buf [S, L, P + 1] int64 contiguous; slot, on [1] int64 (device
    tensors, so a captured graph follows them); rows [T] 0/1 int64 or None (every row counts).
    `pdl`: a programmatic dependent launch (pdl.py)."""
    k = ids.shape[-1] if ids.dim() > 1 else 1
    flat = ids.reshape(-1)
    n = flat.numel()
    if n == 0:
        return
    assert buf.is_contiguous() and buf.dtype == torch.int64
    if not 0 <= layer_id < num_layers:  # an atomic past the buffer would corrupt memory silently
        raise ValueError(f"layer {layer_id} outside the recorder's {num_layers} layers")
    block = min(MAX_BLOCK, max(16, triton.next_power_of_2(n)))
    _count_kernel[(triton.cdiv(n, block),)](
        flat, rows if rows is not None else flat, on, slot, buf, n, layer_id, num_layers,
        buf.shape[-1] - 1, K=k, HAS_ROWS=rows is not None, BLOCK=block, **launch_kwargs(pdl))


@triton.jit(do_not_specialize=["num_pairs", "layer_id"])
def _count_kernel(ids_ptr, rows_ptr, on_ptr, slot_ptr, buf_ptr, num_pairs, layer_id, num_layers,
                  num_physical, K: tl.constexpr, HAS_ROWS: tl.constexpr, BLOCK: tl.constexpr,
                  USE_PDL: tl.constexpr):
    pdl_wait(USE_PDL)
    if tl.load(on_ptr) != 0:
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < num_pairs
        ids = tl.load(ids_ptr + offs, mask=ok, other=0).to(tl.int64)
        ids = tl.where(ids < 0, num_physical, ids)
        if HAS_ROWS:
            add = tl.load(rows_ptr + offs // K, mask=ok, other=0).to(tl.int64)
        else:
            add = tl.full([BLOCK], 1, dtype=tl.int64)
        row = tl.load(slot_ptr) * num_layers + layer_id
        tl.atomic_add(buf_ptr + row * (num_physical + 1) + ids, add, mask=ok & (add != 0))
