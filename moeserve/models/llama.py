"""Dense decoder-only models: Llama, Qwen2 (qkv bias) and Qwen3 (per-head q/k norm).

The attention and MLP blocks here are reused by the MoE models of the same family.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from moeserve.forward_batch import ForwardBatch
from moeserve.kernels.cpu.ops import CpuKernels
from moeserve.layers.activation import silu_and_mul
from moeserve.layers.attention import PagedAttention
from moeserve.layers.linear import Linear, MergedLinear
from moeserve.layers.moe_stages import moe_operations
from moeserve.layers.norm import RMSNorm, rms_norm_heads
from moeserve.layers.rotary import get_rope
from moeserve.tbo.operations import ForwardState, MoEStepState, Op, Yield, run_straight

if TYPE_CHECKING:  # importing it imports Triton
    from moeserve.kernels.triton.ops import TritonOps


def head_dim_of(cfg: Any) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


class Attention(nn.Module):
    cpu_kernels: CpuKernels | None = None  # set on CPU models (kernels/cpu/ops.py)
    gpu_ops: TritonOps | None = None  # set on CUDA models (kernels.triton.ops)

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
        return self.output(self.core(self.prepare(x, positions, fb), fb))

    # The three stages of the op list (DecoderLayer.operations): projections, backend, output.
    def prepare(self, x: torch.Tensor, positions: torch.Tensor,
                fb: ForwardBatch | None = None) -> tuple:
        """→ (q [T, H, D], k [T, Hkv, D], v [T, Hkv * D], kv_stored) with norms and rope
        applied; kv_stored: the GPU rope kernel also wrote k and v into fb's KV pool."""
        qkv = self.qkv_proj(x)  # [T, (H + 2 Hkv) D], a fresh tensor
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        # q and k as one [T, H + Hkv, D] view: their norms and rope in one pass each
        qk = qkv[:, : (h + hkv) * d].view(-1, h + hkv, d)
        kernels, store = self.cpu_kernels, None
        if kernels is None and self.gpu_ops is not None and self.gpu_ops.usable(qkv):
            kernels = self.gpu_ops
            store = None if fb is None else self.attn.store_target(fb, qkv.dtype)
        if kernels is not None and self.rotary.is_neox_style and qkv.stride(1) == 1:
            norms = (self.q_norm.weight, self.k_norm.weight) if self.q_norm else (None, None)
            eps = self.q_norm.eps if self.q_norm else 0.0
            extra = {} if store is None else {"store": store}  # the KV store fused in
            kernels.qk_norm_rope(qkv, h, hkv, d, positions, self.rotary.cos_sin_cache,
                                 self.rotary.rotary_dim, *norms, eps, **extra)  # in place
        else:
            store = None
            if self.q_norm is not None:
                qk = rms_norm_heads(qk, [(h, self.q_norm), (hkv, self.k_norm)])
            qk = self.rotary.rotate(positions, qk)
        return qk[:, :h], qk[:, h:], qkv[:, (h + hkv) * d :], store is not None

    def core(self, qkv: tuple, fb: ForwardBatch) -> torch.Tensor:
        q, k, v, kv_stored = qkv
        return self.attn(q, k, v, fb, kv_stored=kv_stored)  # [T, H * D]

    def output(self, out: torch.Tensor) -> torch.Tensor:
        return self.o_proj(out)


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
        self._ops: list[Op | Yield] | None = None  # built on first use

    @property
    def layer_id(self) -> int:
        return self.self_attn.attn.spec.layer_id

    @property
    def is_moe(self) -> bool:
        """The feed-forward block is routed experts (it has the MoE stages: `route`, `shared`)."""
        return hasattr(getattr(self, self.mlp_name), "route")

    def forward(self, x, residual, positions, fb):
        if not self.is_moe:
            return self._forward_dense(x, residual, positions, fb)
        state = ForwardState(fb, positions, x, residual)
        run_straight(self.operations(), state)
        return state.hidden, state.residual

    def _forward_dense(self, x, residual, positions, fb):
        x, residual = self._input_norm(x, residual)
        x = self.self_attn(x, positions, fb)
        x, residual = self.post_attention_layernorm(x, residual)
        return getattr(self, self.mlp_name)(x, fb), residual

    def _input_norm(self, x, residual):
        return self.input_layernorm(x, residual) if residual is not None else (
            self.input_layernorm(x), x)

    def operations(self) -> list[Op | Yield]:
        """This layer as an op list (tbo/operations.py). A dense layer is one op; a MoE layer
        is attention (prepare, core, output) → router → dispatch start | dispatch wait →
        experts → combine start | combine wait → shared experts → residual, where `|` is a
        yield: the other micro-batch computes while this one's tokens travel."""
        if self._ops is None:
            self._ops = self._moe_operations() if self.is_moe else [
                Op("layer", self._dense_op, self.layer_id)]
        return self._ops

    def _dense_op(self, s: ForwardState) -> None:
        s.hidden, s.residual = self._forward_dense(s.hidden, s.residual, s.positions, s.fb)

    def _moe_operations(self) -> list[Op | Yield]:
        attn, lid = self.self_attn, self.layer_id

        def attn_prepare(s: ForwardState) -> None:
            x, s.residual = self._input_norm(s.hidden, s.residual)
            s.attn = attn.prepare(x, s.positions, s.fb)

        def attn_core(s: ForwardState) -> None:
            s.attn = (attn.core(s.attn, s.fb),)

        def attn_output(s: ForwardState) -> None:
            x, s.attn = attn.output(s.attn[0]), ()
            s.hidden, s.residual = self.post_attention_layernorm(x, s.residual)

        def residual(s: ForwardState) -> None:
            m = s.moe  # the residual itself is added in the next norm (fused)
            s.hidden = m.routed if m.shared is None else m.routed + m.shared
            s.moe = MoEStepState()

        return [Op("attn_prepare", attn_prepare, lid), Op("attn_core", attn_core, lid),
                Op("attn_output", attn_output, lid),
                *moe_operations(getattr(self, self.mlp_name), lid),
                Op("residual", residual, lid)]


class DecoderModel(nn.Module):
    """Embedding → layers → final norm; `make_layer(layer_id)` builds each decoder layer."""

    def __init__(self, cfg: Any, make_layer):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(make_layer(i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self._ops: list[Op | Yield] | None = None

    def main_layers(self) -> list[nn.Module]:
        """The layers a forward runs (DeepSeek keeps its MTP layer after them)."""
        return list(self.layers)

    def operations(self) -> list[Op | Yield]:
        """embed → every layer's ops → final norm: the plain forward runs it straight through,
        two-batch overlap interleaves two micro-batches over it (tbo/operations.py)."""
        if self._ops is None:
            layer_ops = [op for layer in self.main_layers() for op in layer.operations()]
            self._ops = [Op("embed", self._embed), *layer_ops, Op("final_norm", self._final_norm)]
        return self._ops

    def _embed(self, s: ForwardState) -> None:
        s.hidden, s.residual = self.embed_tokens(s.fb.input_ids), None

    def _final_norm(self, s: ForwardState) -> None:
        s.hidden, s.residual = self.norm(s.hidden, s.residual)[0], None

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        state = ForwardState(fb, fb.positions)
        run_straight(self.operations(), state)
        return state.hidden


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
