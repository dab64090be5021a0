"""The attention call site inside a model: hands q/k/v and the layer spec to the batch's backend."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from moeserve.attention.base import AttentionSpec

if TYPE_CHECKING:
    from moeserve.attention.mla_mha import MlaShape
    from moeserve.forward_batch import ForwardBatch
    from moeserve.kernels.triton.attention import KVStoreTarget


class PagedAttention(nn.Module):
    """Attention over the paged KV pool. Holds no weights; the backend owns the computation."""

    def __init__(self, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 scaling: float, v_head_dim: int | None = None):
        super().__init__()
        self.spec = AttentionSpec(layer_id, num_heads, num_kv_heads, head_dim,
                                  v_head_dim or head_dim, scaling)

    def store_target(self, fb: ForwardBatch, dtype: torch.dtype) -> KVStoreTarget | None:
        """Where this layer's new K/V rows go if the caller writes them itself (then it passes
        `kv_stored=True` to forward); None: forward stores them."""
        return fb.attn_backend.kv_store_target(self.spec, fb, dtype)

    def forward_mla_mha(self, q: torch.Tensor, latent: torch.Tensor, fb: ForwardBatch,
                        kv_b_proj: nn.Module, shape: MlaShape,
                        kv_stored: bool = False) -> torch.Tensor:
        """MLA in the MHA form (attention/mla_mha.py): q [T, H, nope + r] roped, latent
        [T, 1, R + r] (stored in the pool unless kv_stored) → [T, H, v]."""
        return fb.attn_backend.forward_mla_mha(q, latent, self.spec, fb, kv_b_proj, shape,
                                               kv_stored=kv_stored)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
                fb: ForwardBatch, kv_stored: bool = False) -> torch.Tensor:
        """q: [T, H*D] or [T, H, D]; returns [T, H * Dv]."""
        s = self.spec
        q = q.view(-1, s.num_heads, s.head_dim)
        k = k.view(-1, s.num_kv_heads, s.head_dim)
        if v is not None:
            v = v.view(-1, s.num_kv_heads, s.v_head_dim)
        if kv_stored:
            out = fb.attn_backend.forward(q, k, v, s, fb, kv_stored=True)
        else:
            out = fb.attn_backend.forward(q, k, v, s, fb)
        return out.reshape(-1, s.num_heads * s.v_head_dim)
