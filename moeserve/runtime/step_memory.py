"""How much GPU memory one forward step's activations need, so the KV pool leaves room for it.

Why: the pool took what was left after the weights, and the largest prefill step then died in
torch's allocator (issue 44). The estimate is per token of the step: the widest tensors that live
together inside one layer (the residual stream and its norm, the attention projections and
output, the MLP or MoE intermediates of the routed copies), plus MLA's per-chunk decompressed K/V
(attention/mla_mha.py) and the logits of one token per request. It errs high by a factor
(ACTIVATION_HEADROOM) for the allocator's rounding and the temporaries it does not list.
"""

from __future__ import annotations

from typing import Any

import torch

ACTIVATION_HEADROOM = 2.0


def _attention_width(c: Any) -> int:
    """Elements a token's attention tensors take at once (projections, scores' inputs, out)."""
    heads = c.num_attention_heads
    if getattr(c, "kv_lora_rank", None):  # MLA: q, its absorbed/latent form, K/V, output
        qk = c.qk_nope_head_dim + c.qk_rope_head_dim
        return heads * (qk + c.kv_lora_rank + c.qk_rope_head_dim + 2 * c.v_head_dim) \
            + c.kv_lora_rank + c.qk_rope_head_dim
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    kv = getattr(c, "num_key_value_heads", None) or heads
    return (2 * heads + 2 * kv) * head_dim


def _mlp_width(c: Any) -> int:
    """Elements of a token's MLP or MoE intermediates: the routed copies' gate/up and input."""
    widths = [3 * (getattr(c, "intermediate_size", 0) or 0)]
    experts = getattr(c, "n_routed_experts", None) or getattr(c, "num_experts", None)
    if experts:
        inter = getattr(c, "moe_intermediate_size", None) or c.intermediate_size
        k = c.num_experts_per_tok
        shared = (getattr(c, "n_shared_experts", 0) or 0) * inter
        widths.append(k * (3 * inter + 2 * c.hidden_size) + 3 * shared)
    return max(widths)


def step_activation_bytes(hf_config: Any, tokens: int, requests: int, dtype: torch.dtype,
                          mla_chunk_tokens: int = 0) -> int:
    """Bytes one step of `tokens` new tokens over `requests` requests may hold beyond the weights
    and KV pool. mla_chunk_tokens: the MHA form's decompressed K/V chunk (MLA models)."""
    c = hf_config
    elem = torch.finfo(dtype).bits // 8
    per_token = 4 * c.hidden_size + max(_attention_width(c), _mlp_width(c))
    total = tokens * per_token * elem
    if getattr(c, "kv_lora_rank", None) and mla_chunk_tokens:
        heads, v = c.num_attention_heads, c.v_head_dim
        chunk = mla_chunk_tokens * (heads * (c.qk_nope_head_dim + v) + c.kv_lora_rank
                                    + c.qk_rope_head_dim)
        total += chunk * elem + tokens * heads * (v + 1) * 4  # + float32 partial outputs
    total += requests * c.vocab_size * 4  # float32 logits of each request's last token
    return int(total * ACTIVATION_HEADROOM)
