"""Attention backend interface and the per-layer attention spec that models hand to it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from moeserve.attention import mla_mha

if TYPE_CHECKING:
    from moeserve.kernels.triton.attention import KVStoreTarget
    from moeserve.runtime.forward_batch import ForwardBatch


@dataclass(frozen=True)
class AttentionSpec:
    """What a backend needs to know about one attention layer.

    For absorbed MLA: num_kv_heads = 1, head_dim = kv_lora_rank + rope_dim and v_head_dim =
    kv_lora_rank (the value is a prefix of the key).
    """

    layer_id: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    scaling: float


class AttentionBackend(ABC):
    """Stores the new tokens' K/V in the pool and attends over each request's whole sequence.

    `init_forward_metadata` runs once per ForwardBatch (before the first layer) and may cache index
    tensors in `fb.attn_metadata`; `forward` runs once per layer.

    `graph_safe` backends can be captured in a CUDA graph for DECODE: there both methods only
    launch device work from fb's device tensors (never the *_cpu lists, stale at replay), with no
    host sync and no state kept across steps.
    """

    graph_safe: bool = False
    reads_sdpa_prefill: bool = False  # attends fb.sdpa_prefill steps with SDPA (sdpa_prefill.py)

    @abstractmethod
    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        ...

    def kv_store_target(self, spec: AttentionSpec, fb: ForwardBatch,
                        dtype: torch.dtype) -> KVStoreTarget | None:
        """Where the layer's new K/V rows (of `dtype`) go, for a caller that can write them
        itself as it produces them (fused into its rope kernel); it then calls `forward` with
        `kv_stored=True`. None (the default): `forward` stores them."""
        return None

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
                spec: AttentionSpec, fb: ForwardBatch, kv_stored: bool = False) -> torch.Tensor:
        """q: [T, H, D], k: [T, Hkv, D], v: [T, Hkv, Dv] (None for MLA) → [T, H, Dv].
        kv_stored: k and v are already in the pool at fb.out_cache_loc (`kv_store_target`)."""

    # ---- MLA's MHA form (attention/mla_mha.py) ------------------------------------------------
    mla_block_m: int = 64  # query rows per block of the MHA form's plan

    def forward_mla_mha(self, q: torch.Tensor, latent: torch.Tensor, spec: AttentionSpec,
                        fb: ForwardBatch, kv_b_proj, shape: mla_mha.MlaShape,
                        kv_stored: bool = False) -> torch.Tensor:
        """MLA prefill/extend in the MHA form: stores the new latents, then attends each piece
        of decompressed K/V (`attend_mla_piece`). q: [T, H, nope + r] → [T, H, v]."""
        if not kv_stored:
            fb.kv_pool.set_kv(spec.layer_id, fb.out_cache_loc, latent, None)
        if fb.mla_plan is None:
            fb.mla_plan = mla_mha.build_plan(fb, fb.mla_mha_chunk, self.mla_block_m)
        return mla_mha.run_pieces(q, fb.kv_pool.key_buffer(spec.layer_id), kv_b_proj, shape,
                                  spec.scaling, fb.mla_plan, self.attend_mla_piece)

    def attend_mla_piece(self, *args) -> None:
        """One piece into the running result (mla_mha.run_pieces' `attend`): the torch
        reference here; the Triton backend runs its kernel."""
        mla_mha.attend_piece_torch(*args)
