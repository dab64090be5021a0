"""Triton attention over the token-slot KV pool (`attention.backend=triton`), MHA/GQA and MLA."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeserve.attention.base import AttentionBackend, AttentionSpec
from moeserve.attention.sdpa_prefill import sdpa_prefill
from moeserve.forward_batch import ForwardBatch
from moeserve.host_copy import to_device
from moeserve.kernels.triton.attention import KVStoreTarget, decode_attention, store_kv
from moeserve.kernels.triton.attention_extend import (extend_attention, extend_block_m,
                                                      extend_blocks)
from moeserve.kernels.triton.attention_mla_chunk import MLA_CHUNK_BLOCK_M, mla_chunk_attention
from moeserve.kvcache.pool import KVPool, MLAKVPool


@dataclass
class ExtendMetadata:
    """The extend kernel's index tensors (int32), built from the host-side lengths, or views of
    the static buffers a CUDA graph of extend steps reads (runtime/extend_graph.py)."""

    qo_start: torch.Tensor  # [B + 1]: request i's new tokens are rows qo_start[i]:[i + 1]
    prefix_lens: torch.Tensor  # [B] tokens already cached
    blk_req: torch.Tensor  # [NB] request of each query block (kernels: extend_blocks)
    blk_m: torch.Tensor  # [NB] its block index within the request's new tokens

INTERPRETED_SPLITS = 2  # decode KV splits at most on CPU tensors (kv_splits)


def extend_block_m_of(pool: KVPool, rows: int | None = None) -> int:
    """The extend block table's granularity for a pool's key width (the kernel's BLOCK_M);
    `rows`: attention.extend_block_m."""
    main = pool.kv_lora_rank if isinstance(pool, MLAKVPool) else pool.key_buffer(0).shape[-1]
    return extend_block_m(main, rows)


class TritonAttentionBackend(AttentionBackend):
    """Stores the step's K/V with one kernel, then attends from the pool only.

    Decode is flash-decoding with a KV split count that depends on the batch size only, so a decode step launches
    the same grids whatever the sequence lengths and reads only fb's device tensors: it can be
    captured in a CUDA graph and replayed with new contents. Extend's grid is a block table of
    the new tokens' query blocks, built here from the host-side lengths (eager) or padded to a
    token bucket by the extend graphs (`extend_graph_safe`). MLA (an MLAKVPool, v None) attends the latent in absorbed form:
    key = [R main | r rope] channels, value = the main R.
    """

    graph_safe = True
    extend_graph_safe = True  # extend reads only ExtendMetadata tensors (static in a graph)
    reads_sdpa_prefill = True

    def __init__(self, num_kv_splits: int | None = None, pdl: bool = False,
                 extend_block_m: int | None = None):
        self.num_kv_splits = num_kv_splits  # None: by batch size (`kv_splits`)
        self.pdl = pdl  # decode kernels as programmatic dependent launches (kernels/triton/pdl.py)
        self.extend_rows = extend_block_m  # attention.extend_block_m; None: the kernel's choice

    def extend_block_m(self, pool: KVPool) -> int:
        """Query rows per extend program (and block-table entry) for this pool."""
        return extend_block_m_of(pool, self.extend_rows)

    def kv_splits(self, batch: int, programs_per_request: int, mla: bool = False,
                  interpreted: bool = False) -> int:
        """The fewest splits (a power of two, 1 to 32) that give the decode kernel ~512 programs
        (MLA's, 16 latent heads each, ~256): measured on an H200 (`bench.attention_kernels
        --num-kv-splits`), more and shorter programs only lost there, e.g. Qwen3-30B-A3B at
        batch 256 / 512 tokens 75.4 µs with 1 split, 86.6 with 4. A function of shapes only, so
        a captured graph keeps its own. `interpreted` (CPU tensors: Triton's interpreter runs the
        programs one by one, each at a fixed cost of ~30 ms): at most INTERPRETED_SPLITS, which
        still merge (a batch-4 MLA test spent 127 of its 137 s in 32 mostly empty splits)."""
        if self.num_kv_splits is not None:
            return self.num_kv_splits
        want = -(-(256 if mla else 512) // max(batch * programs_per_request, 1))
        splits = min(32, 1 << (want - 1).bit_length())
        return min(splits, INTERPRETED_SPLITS) if interpreted else splits

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        if fb.forward_mode.is_decode():
            fb.attn_metadata = None  # decode needs nothing beyond fb's device tensors
            return
        lens = fb.extend_seq_lens_cpu
        b = len(lens)
        starts = [0]
        for n in lens:
            starts.append(starts[-1] + n)
        if fb.sdpa_prefill is not None:  # SDPA's requests take no blocks
            lens = [0 if f else n for n, f in zip(lens, fb.sdpa_prefill.requests)]
        reqs, blocks = extend_blocks(lens, self.extend_block_m(fb.kv_pool))
        host = torch.tensor(starts + fb.extend_prefix_lens_cpu + reqs + blocks, dtype=torch.int32)
        dev = to_device(host, fb.req_pool_indices.device)  # one copy, not waiting for the stream
        nb = len(reqs)
        fb.attn_metadata = ExtendMetadata(dev[: b + 1], dev[b + 1: 2 * b + 1],
                                          dev[2 * b + 1: 2 * b + 1 + nb], dev[2 * b + 1 + nb:])

    mla_block_m = MLA_CHUNK_BLOCK_M

    def attend_mla_piece(self, q, kv, k_pe, piece, plan, out, lse, scale, single) -> None:
        """MLA's MHA form: one piece of decompressed K/V (kernels/triton/attention_mla_chunk)."""
        mla_chunk_attention(q, kv, k_pe, piece.meta, len(piece.seg_req), piece.num_blocks,
                            plan.qo_start, plan.prefix_lens, out, lse, scale, single)

    def kv_store_target(self, spec: AttentionSpec, fb: ForwardBatch,
                        dtype: torch.dtype) -> KVStoreTarget | None:
        """Pools of the rows' own dtype (the fused writers do not cast). MLA pools: v_buf is the
        latent buffer too (V lives in K; the MLA writer reads only k_buf)."""
        pool = fb.kv_pool
        if pool.dtype != dtype:
            return None
        k_buf = pool.key_buffer(spec.layer_id)
        v_buf = k_buf if isinstance(pool, MLAKVPool) else pool.value_buffer(spec.layer_id)
        return KVStoreTarget(k_buf, v_buf, fb.out_cache_loc)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
                spec: AttentionSpec, fb: ForwardBatch, kv_stored: bool = False) -> torch.Tensor:
        q, k = _rows_contiguous(q), _rows_contiguous(k)
        v = None if v is None else _rows_contiguous(v)
        pool = fb.kv_pool
        k_buf = pool.key_buffer(spec.layer_id)
        v_buf = None if v is None else pool.value_buffer(spec.layer_id)  # None: MLA, V in K
        if not kv_stored:
            store_kv(k, v, fb.out_cache_loc, k_buf, v_buf, pdl=self.pdl)
        dk = spec.head_dim if v is not None else spec.v_head_dim  # MLA: main part R; rest rope
        out = q.new_empty((q.shape[0], spec.num_heads, spec.v_head_dim))  # [T, H, Dv]
        if q.shape[0] == 0:
            return out
        table = fb.req_to_token_pool.req_to_token
        if fb.forward_mode.is_decode():
            b = q.shape[0]
            per_req = k_buf.shape[1] if v is not None else -(-spec.num_heads // 16)
            splits = self.kv_splits(b, per_req, mla=v is None,
                                    interpreted=q.device.type == "cpu")
            part_out = torch.empty((b, spec.num_heads, splits, spec.v_head_dim),
                                   dtype=torch.float32, device=q.device)
            part_lse = torch.empty((b, spec.num_heads, splits), dtype=torch.float32,
                                   device=q.device)
            decode_attention(q, k_buf, v_buf, table, fb.req_pool_indices, fb.seq_lens,
                             spec.scaling, dk, spec.v_head_dim, out, part_out, part_lse,
                             pdl=self.pdl)
            return out
        meta: ExtendMetadata = fb.attn_metadata
        if fb.sdpa_prefill is not None:  # fresh prompts: their own keys, contiguous
            out = sdpa_prefill(q, k, v, fb.extend_seq_lens_cpu, spec.scaling, out,
                               fb.sdpa_prefill.backend, only=fb.sdpa_prefill.requests)
        extend_attention(q, k_buf, v_buf, table, fb.req_pool_indices, meta.qo_start,
                         meta.prefix_lens, meta.blk_req, meta.blk_m, spec.scaling, dk,
                         spec.v_head_dim, out, block_m=self.extend_block_m(pool))
        return out


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    """The kernels index [T, heads, dim] by the first two strides and need a unit last stride."""
    return x if x.stride(-1) == 1 else x.contiguous()
