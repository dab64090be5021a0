"""Reference attention in plain PyTorch over the token-slot KV layout (CPU and CUDA)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from moeserve.attention.base import AttentionBackend, AttentionSpec
from moeserve.forward_batch import ForwardBatch


DECODE_LEN_BUCKET = 64
DECODE_KV_KEEP_BYTES = 256 << 20  # at most this much gathered decode K/V is kept across steps


@dataclass
class _TorchMetadata:
    kv_indices: torch.Tensor  # [B, max_seq] KV slot per (request, position); 0-padded
    token_ranges: list[tuple[int, int]]  # per request: [start, end) in the token-major tensors
    _head_rows: dict[int, torch.Tensor] = field(default_factory=dict)
    # decode only: 0 / -inf per (request, position), [B, 1, 1, max_seq]
    mask_bias: torch.Tensor | None = None
    # decode on CPU: (rows, seq_lens, max_seq) of this step, and of the step that this one extends
    # by one token per request (see _KeptKV)
    step_key: tuple | None = None
    prev_key: tuple | None = None
    append_at: tuple[torch.Tensor, torch.Tensor] | None = None  # (request, position) of new tokens

    def head_rows(self, kv_heads: int) -> torch.Tensor:
        """[B * Hkv * S] rows of a [slots * Hkv, D] view of a KV buffer, head-major per request,
        so one gather yields [B, Hkv, S, D] (built once per batch, shared by the layers)."""
        rows = self._head_rows.get(kv_heads)
        if rows is None:
            heads = torch.arange(kv_heads, device=self.kv_indices.device)
            rows = (self.kv_indices[:, None, :] * kv_heads + heads[None, :, None]).reshape(-1)
            self._head_rows[kv_heads] = rows
        return rows


@dataclass
class _KeptKV:
    """One layer's decode K and V as gathered for the step `key` ([B, Hkv, S, D] each).

    Why: consecutive decode steps of an unchanged batch read the same K/V plus one new token per
    request, and re-gathering it for every layer was the largest part of CPU decode attention (two
    index_selects per layer, ~0.1 ms each for 16 requests of 256 tokens). The next step whose key is
    this one's with every seq_len + 1 appends its new row instead. The positions below seq_len - 1
    of a running request never change between two decode steps; any other step (extend, verify,
    idle, a two-batch-overlap micro-batch) drops everything kept, so a request re-admitted into the
    same row is gathered afresh.
    """

    key: tuple
    k: torch.Tensor
    v: torch.Tensor


class TorchAttentionBackend(AttentionBackend):
    """Gathers each request's K/V from the pool and runs SDPA.

    Decode batches are attended in one padded batch of matmuls (`_decode_attention`); extend
    batches loop over requests with SDPA and a causal mask offset by the cached prefix length. On
    CPU, decode K/V gathered for one step is kept and extended by the next (`_KeptKV`).
    """

    def __init__(self):
        self._kept: dict[int, _KeptKV] = {}  # layer id → its decode K/V of the last decode step
        self._kept_bytes = 0  # their total size

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        table = fb.req_to_token_pool.req_to_token
        max_len = max(fb.seq_lens_cpu, default=0)
        if fb.forward_mode.is_decode():
            # KV length in buckets, masked past each sequence: the same matmul shapes for many
            # steps (a new shape every step made each CPU bf16 bmm ~3x slower: 235 µs in the
            # model against 75 µs for a repeated shape)
            bucket = -(-max_len // DECODE_LEN_BUCKET) * DECODE_LEN_BUCKET
            max_len = min(bucket, table.shape[1])
        kv_indices = table[fb.req_pool_indices, :max_len]
        positions = torch.arange(max_len, device=table.device)
        kv_mask = positions[None, :] < fb.seq_lens[:, None]
        kv_indices = torch.where(kv_mask, kv_indices, torch.zeros_like(kv_indices))
        starts = [0]
        for n in fb.extend_seq_lens_cpu:
            starts.append(starts[-1] + n)
        ranges = list(zip(starts[:-1], starts[1:]))
        meta = _TorchMetadata(kv_indices, ranges)
        if fb.forward_mode.is_decode():
            meta.mask_bias = torch.zeros(kv_mask.shape, dtype=torch.float32, device=table.device)
            meta.mask_bias.masked_fill_(~kv_mask, float("-inf"))
            meta.mask_bias = meta.mask_bias[:, None, None, :]
        # NOTE: a TBO micro-batch keeps nothing: its two halves would evict each other's K/V
        rows = tuple(fb.req_pool_indices.tolist()) if table.device.type == "cpu" else ()
        # NOTE: a speculative verify batch repeats a row per query; the next one is a step
        # further only where nothing was rejected, so such batches keep nothing either; nor do
        # batches over a draft tree's scratch rows (past the pool's live rows), which hold other
        # nodes' ancestors every step
        if (fb.forward_mode.is_decode() and table.device.type == "cpu" and not fb.micro_batch
                and len(set(rows)) == len(rows)
                and max(rows, default=0) < fb.req_to_token_pool.size):
            meta.step_key = (rows, tuple(fb.seq_lens_cpu), max_len)
            meta.prev_key = (rows, tuple(n - 1 for n in fb.seq_lens_cpu), max_len)
            meta.append_at = (torch.arange(len(rows), device=table.device), fb.seq_lens - 1)
        else:
            self._kept.clear()
            self._kept_bytes = 0
        fb.attn_metadata = meta

    def forward(self, q, k, v, spec: AttentionSpec, fb: ForwardBatch,
                kv_stored: bool = False) -> torch.Tensor:
        assert not kv_stored  # kv_store_target is None here
        fb.kv_pool.set_kv(spec.layer_id, fb.out_cache_loc, k, v)
        k_buf = fb.kv_pool.key_buffer(spec.layer_id)
        v_buf = fb.kv_pool.value_buffer(spec.layer_id)
        if fb.forward_mode.is_decode():
            k, v = self._decode_kv(k_buf, v_buf, q.dtype, spec.layer_id, fb)
            return _decode_attention(q, k, v, spec, fb.attn_metadata.mask_bias)
        return self._extend(q, k_buf, v_buf, spec, fb)

    def _decode_kv(self, k_buf, v_buf, dtype, layer_id: int, fb: ForwardBatch):
        """This step's K and V as [B, Hkv, S, D]: the last step's extended by the new tokens where
        it was kept for the same requests one token shorter, else gathered (and kept, on CPU)."""
        meta: _TorchMetadata = fb.attn_metadata
        kept = self._kept.get(layer_id)
        if kept is not None and kept.key == meta.prev_key:
            b, pos = meta.append_at
            kept.k[b, :, pos] = _gather(k_buf, fb.out_cache_loc, dtype)  # [B, Hkv, D]
            kept.v[b, :, pos] = _gather(v_buf, fb.out_cache_loc, dtype)
            kept.key = meta.step_key
            return kept.k, kept.v
        k = _gather_heads(k_buf, meta, dtype)  # [B, Hkv, S, D]
        v = _gather_heads(v_buf, meta, dtype)  # [B, Hkv, S, Dv]
        old = self._kept.pop(layer_id, None)
        if old is not None:
            self._kept_bytes -= old.k.nbytes + old.v.nbytes
        size = k.nbytes + v.nbytes
        if meta.step_key is not None and self._kept_bytes + size <= DECODE_KV_KEEP_BYTES:
            self._kept[layer_id] = _KeptKV(meta.step_key, k, v)
            self._kept_bytes += size
        return k, v

    def _extend(self, q, k_buf, v_buf, spec, fb: ForwardBatch) -> torch.Tensor:
        meta: _TorchMetadata = fb.attn_metadata
        out = q.new_empty((q.shape[0], spec.num_heads, spec.v_head_dim))
        for i, (start, end) in enumerate(meta.token_ranges):
            seq_len, prefix = fb.seq_lens_cpu[i], fb.extend_prefix_lens_cpu[i]
            idx = meta.kv_indices[i, :seq_len]
            k = _gather(k_buf, idx, q.dtype)[None]  # [1, S, Hkv, D]
            v = _gather(v_buf, idx, q.dtype)[None]
            q_pos = torch.arange(prefix, prefix + end - start, device=q.device)
            mask = q_pos[:, None] >= torch.arange(seq_len, device=q.device)[None, :]  # [Tq, S]
            out[start:end] = _sdpa(q[None, start:end], k, v, spec, mask[None, None])[0]
        return out


def _gather(buf: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """buf[slots] as `dtype`; index_select copies whole rows (several times faster than advanced
    indexing on CPU)."""
    return buf.index_select(0, slots).to(dtype)


def _gather_heads(buf: torch.Tensor, meta: _TorchMetadata, dtype: torch.dtype) -> torch.Tensor:
    """Each request's K (or V) as [B, Hkv, S, D]: gathered head-major, so the attention matmuls
    read it without a transposing copy (a [B, S, Hkv, D] gather needed two per layer: SmolLM2
    decode spent ~8 ms of 60 in them)."""
    b, s = meta.kv_indices.shape
    hkv = buf.shape[1]
    if hkv == 1:  # MLA: the value buffer is a strided view of the key buffer
        return _gather(buf, meta.kv_indices.reshape(-1), dtype).view(b, 1, s, -1)
    return _gather(buf.view(-1, buf.shape[-1]), meta.head_rows(hkv), dtype).view(b, hkv, s, -1)


def _decode_attention(q, k, v, spec: AttentionSpec, mask_bias) -> torch.Tensor:
    """One query per request, the query heads of each KV head batched as one matmul (no
    broadcast K/V copies, no SDPA kernel: CPU SDPA is slow for a single query, in bf16 worst).

    q: [B, H, D], k: [B, Hkv, S, D], v: [B, Hkv, S, Dv], mask_bias: [B, 1, 1, S] (0 or -inf)
    → [B, H, Dv]. Scores and softmax in float32.
    """
    b, h, d = q.shape
    hkv = k.shape[1]
    qg = q.view(b, hkv, h // hkv, d)  # query head i uses KV head i // (H / Hkv)
    # bias + scaling * float(scores) in one op: [B, Hkv, G, S]
    scores = torch.add(mask_bias, torch.matmul(qg, k.transpose(-1, -2)), alpha=spec.scaling)
    probs = scores.softmax(-1).to(v.dtype)
    return torch.matmul(probs, v).reshape(b, h, -1)  # [B, H, Dv]


def _sdpa(q, k, v, spec: AttentionSpec, mask) -> torch.Tensor:
    """q: [B, Tq, H, D], k: [B, S, Hkv, D], v: [B, S, Hkv, Dv], mask broadcastable to [B, H, Tq, S]."""
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # → [B, heads, len, dim]
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=spec.scaling,
        enable_gqa=spec.num_heads != spec.num_kv_heads,
    )
    return out.transpose(1, 2)
