"""CPU attention backend: decode through one C kernel per layer (`kernels/cpu/`)."""

from __future__ import annotations

import torch

from moeserve.attention.base import AttentionSpec
from moeserve.attention.torch_backend import TorchAttentionBackend
from moeserve.forward_batch import ForwardBatch
from moeserve.kernels.cpu.ops import CpuKernels, supports
from moeserve.kvcache.pool import MHAKVPool

_FUSED_DECODE = "cpu-fused-decode"  # attn_metadata of a decode step the kernel runs


class CpuAttentionBackend(TorchAttentionBackend):
    """Decode steps of MHA/GQA pools store the new K/V and attend each request straight from the
    pool through its slot table, in one kernel call per layer: no K/V gather, no mask, no per-step
    index tensors (on a tiny Qwen3-MoE these were ~20 torch ops per layer and the per-step
    metadata). Extend batches and MLA pools run the torch backend's path."""

    def __init__(self, kernels: CpuKernels):
        super().__init__()
        self.kernels = kernels

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        pool = fb.kv_pool
        if fb.forward_mode.is_decode() and isinstance(pool, MHAKVPool) and supports(pool.dtype):
            fb.attn_metadata = _FUSED_DECODE
            return
        super().init_forward_metadata(fb)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
                spec: AttentionSpec, fb: ForwardBatch, kv_stored: bool = False) -> torch.Tensor:
        assert not kv_stored  # kv_store_target is None here
        if fb.attn_metadata is not _FUSED_DECODE:
            return super().forward(q, k, v, spec, fb)
        pool = fb.kv_pool
        return self.kernels.decode_attention(
            q.to(pool.dtype), k.to(pool.dtype), v.to(pool.dtype), fb.out_cache_loc,
            pool.key_buffer(spec.layer_id), pool.value_buffer(spec.layer_id),
            fb.req_to_token_pool.req_to_token, fb.req_pool_indices, fb.seq_lens, spec.scaling,
            fb.shared_prefix)
