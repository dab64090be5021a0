"""Dense decoder-only models: Llama, Qwen2 (qkv bias) and Qwen3 (per-head q/k norm).

The attention and MLP blocks here are reused by the MoE models of the same family.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from moeserve.forward_batch import ForwardBatch
from moeserve.kernels.cpu_ops import CpuKernels
from moeserve.layers.activation import silu_and_mul
from moeserve.layers.attention import PagedAttention
from moeserve.layers.linear import Linear, MergedLinear
from moeserve.layers.norm import RMSNorm, rms_norm_heads
from moeserve.layers.rotary import get_rope

if TYPE_CHECKING:  # importing it imports Triton
    from moeserve.kernels.triton_ops import TritonOps


def head_dim_of(cfg: Any) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


class Attention(nn.Module):
    cpu_kernels: CpuKernels | None = None  # set on CPU models (kernels.cpu_ops)
    gpu_ops: TritonOps | None = None  # set on CUDA models (kernels.triton_ops)

    def __init__(self, cfg: Any, layer_id: int, qkv_bias: bool = False, qk_norm: bool = False):
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = head_dim_of(cfg)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.sizes = [q_size, kv_size, kv_size]
        self.qkv_proj = MergedLinear(cfg.hidden_size, self.sizes, ["q", "k", "v"], bias=qkv_bias)
        self.o_proj = Linear(q_size, cfg.hidden_size,
                                bias=getattr(cfg, "attention_bias", False) and not qkv_bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.rotary = get_rope(cfg, self.head_dim, cfg.max_position_embeddings)
        self.attn = PagedAttention(layer_id, self.num_heads, self.num_kv_heads, self.head_dim,
                                   self.head_dim**-0.5)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        qkv = self.qkv_proj(x)  # [T, (H + 2 Hkv) D], a fresh tensor
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        # q and k as one [T, H + Hkv, D] view: their norms and rope in one pass each
        qk = qkv[:, : (h + hkv) * d].view(-1, h + hkv, d)
        kernels = self.cpu_kernels
        if kernels is None and self.gpu_ops is not None and self.gpu_ops.usable(qkv):
            kernels = self.gpu_ops
        if kernels is not None and self.rotary.is_neox_style and qkv.stride(1) == 1:
            norms = (self.q_norm.weight, self.k_norm.weight) if self.q_norm else (None, None)
            eps = self.q_norm.eps if self.q_norm else 0.0
            kernels.qk_norm_rope(qkv, h, hkv, d, positions, self.rotary.cos_sin_cache,
                                 self.rotary.rotary_dim, *norms, eps)  # in place
        else:
            if self.q_norm is not None:
                qk = rms_norm_heads(qk, [(h, self.q_norm), (hkv, self.k_norm)])
            qk = self.rotary.rotate(positions, qk)
        q, k, v = qk[:, :h], qk[:, h:], qkv[:, (h + hkv) * d :]
        return self.o_proj(self.attn(q, k, v, fb))


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False):
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden_size, [intermediate_size] * 2, ["gate", "up"], bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor, fb: ForwardBatch | None = None) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(.)); the residual add is fused into the
    next norm. `attn` is GQA (here) or MLA (DeepSeek)."""

    def __init__(self, cfg: Any, attn: nn.Module, mlp: nn.Module, mlp_name: str = "mlp"):
        super().__init__()
        self.self_attn = attn
        self.mlp_name = mlp_name  # checkpoint name of the feed-forward block
        setattr(self, mlp_name, mlp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, positions, fb):
        x, residual = self.input_layernorm(x, residual) if residual is not None else (
            self.input_layernorm(x), x)
        x = self.self_attn(x, positions, fb)
        x, residual = self.post_attention_layernorm(x, residual)
        return getattr(self, self.mlp_name)(x, fb), residual


class DecoderModel(nn.Module):
    """Embedding → layers → final norm; `make_layer(layer_id)` builds each decoder layer."""

    def __init__(self, cfg: Any, make_layer):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(make_layer(i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        x, residual = self.embed_tokens(fb.input_ids), None
        for layer in self.layers:
            x, residual = layer(x, residual, fb.positions, fb)
        x, _ = self.norm(x, residual)
        return x


class CausalLM(nn.Module):
    """A decoder stack plus the LM head (tied to the embedding when the config says so)."""

    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up"),
    }

    def __init__(self, cfg: Any, model: nn.Module):
        super().__init__()
        self.config = cfg
        self.model = model
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if getattr(cfg, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """→ final hidden states [T, hidden]."""
        return self.model(fb)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, hidden] → [T, V] in the model dtype (the runner upcasts where asked)."""
        return self.lm_head(hidden)

    def skip_weight(self, name: str) -> bool:
        tied = getattr(self.config, "tie_word_embeddings", False)
        return "rotary_emb.inv_freq" in name or (tied and name == "lm_head.weight")


class LlamaForCausalLM(CausalLM):
    qkv_bias, qk_norm = False, False

    def __init__(self, cfg: Any, parallel: Any = None):
        def make_layer(i: int) -> DecoderLayer:
            mlp = MLP(cfg.hidden_size, cfg.intermediate_size, getattr(cfg, "mlp_bias", False))
            attn = Attention(cfg, i, qkv_bias=self.qkv_bias or getattr(cfg, "attention_bias", False),
                             qk_norm=self.qk_norm)
            return DecoderLayer(cfg, attn, mlp)

        super().__init__(cfg, DecoderModel(cfg, make_layer))


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
