"""Reference attention in plain PyTorch over the token-slot KV layout (CPU and CUDA)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from moeserve.attention.base import AttentionBackend, AttentionSpec
from moeserve.forward_batch import ForwardBatch


DECODE_LEN_BUCKET = 64


@dataclass
class _TorchMetadata:
    kv_indices: torch.Tensor  # [B, max_seq] KV slot per (request, position); 0-padded
    kv_mask: torch.Tensor  # [B, max_seq] True where the position exists
    token_ranges: list[tuple[int, int]]  # per request: [start, end) in the token-major tensors
    _head_rows: dict[int, torch.Tensor] = field(default_factory=dict)

    def head_rows(self, kv_heads: int) -> torch.Tensor:
        """[B * Hkv * S] rows of a [slots * Hkv, D] view of a KV buffer, head-major per request,
        so one gather yields [B, Hkv, S, D] (built once per batch, shared by the layers)."""
        rows = self._head_rows.get(kv_heads)
        if rows is None:
            heads = torch.arange(kv_heads, device=self.kv_indices.device)
            rows = (self.kv_indices[:, None, :] * kv_heads + heads[None, :, None]).reshape(-1)
            self._head_rows[kv_heads] = rows
        return rows


class TorchAttentionBackend(AttentionBackend):
    """Gathers each request's K/V from the pool and runs SDPA.

    Decode batches are attended in one padded batch of matmuls (`_decode_attention`); extend
    batches loop over requests with SDPA and a causal mask offset by the cached prefix length.
    """

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
        fb.attn_metadata = _TorchMetadata(kv_indices, kv_mask, ranges)

    def forward(self, q, k, v, spec: AttentionSpec, fb: ForwardBatch) -> torch.Tensor:
        fb.kv_pool.set_kv(spec.layer_id, fb.out_cache_loc, k, v)
        k_buf = fb.kv_pool.key_buffer(spec.layer_id)
        v_buf = fb.kv_pool.value_buffer(spec.layer_id)
        if fb.forward_mode.is_decode():
            return self._decode(q, k_buf, v_buf, spec, fb.attn_metadata)
        return self._extend(q, k_buf, v_buf, spec, fb)

    def _decode(self, q, k_buf, v_buf, spec, meta: _TorchMetadata) -> torch.Tensor:
        k = _gather_heads(k_buf, meta, q.dtype)  # [B, Hkv, S, D]
        v = _gather_heads(v_buf, meta, q.dtype)  # [B, Hkv, S, Dv]
        return _decode_attention(q, k, v, spec, meta.kv_mask)

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


def _decode_attention(q, k, v, spec: AttentionSpec, mask) -> torch.Tensor:
    """One query per request, the query heads of each KV head batched as one matmul (no
    broadcast K/V copies, no SDPA kernel: CPU SDPA is slow for a single query, in bf16 worst).

    q: [B, H, D], k: [B, Hkv, S, D], v: [B, Hkv, S, Dv], mask: [B, S] → [B, H, Dv]. Scores and
    softmax in float32.
    """
    b, h, d = q.shape
    hkv = k.shape[1]
    qg = q.view(b, hkv, h // hkv, d)  # query head i uses KV head i // (H / Hkv)
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() * spec.scaling  # [B, Hkv, G, S]
    scores.masked_fill_(~mask[:, None, None, :], float("-inf"))
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
