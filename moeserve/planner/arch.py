"""The shape of a model as the planner needs it: which GEMMs a layer runs, its attention kind, its
experts, read from the same HF config the runtime builds the model from (a shipped shape of
`tools.make_random`, or a checkpoint folder's config.json)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any


@dataclass(frozen=True)
class Linear:
    name: str
    k: int  # input features
    n: int  # output features
    fp8: bool = True  # quantized when the deployment runs FP8 (routers, LM head stay 16-bit)


@dataclass(frozen=True)
class ModelShape:
    name: str
    hidden: int
    layers: int
    moe_layers: int
    vocab: int
    attention: str  # mla | gqa
    heads: int
    kv_heads: int
    head_dim: int  # GQA head dim; MLA: qk_nope + rope
    v_head_dim: int
    kv_lora: int  # MLA latent (0 for GQA)
    rope_dim: int  # MLA decoupled rope dim
    q_lora: int  # MLA q LoRA rank (0: none)
    dense_inter: int
    experts: int  # routed experts (0: dense model)
    topk: int
    moe_inter: int
    shared_experts: int
    groups: int  # DeepSeek expert groups (1: none)
    topk_groups: int
    mtp_layers: int
    fp8_checkpoint: bool

    @property
    def dense_layers(self) -> int:
        return self.layers - self.moe_layers

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    def attention_linears(self, prefill: bool) -> list[Linear]:
        """One layer's attention projections. MLA decode absorbs kv_b into per-head products
        (priced apart, `mla_absorb`); MLA prefill in MHA form runs kv_b as a GEMM."""
        h = self.hidden
        if self.attention == "mla":
            qk = self.heads * self.head_dim
            out = ([Linear("q_a+kv_a", h, self.q_lora + self.kv_lora + self.rope_dim),
                    Linear("q_b", self.q_lora, qk)] if self.q_lora
                   else [Linear("q+kv_a", h, qk + self.kv_lora + self.rope_dim)])
            if prefill:
                nope = self.head_dim - self.rope_dim
                out.append(Linear("kv_b", self.kv_lora, self.heads * (nope + self.v_head_dim)))
            return out + [Linear("o_proj", self.heads * self.v_head_dim, h)]
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return [Linear("qkv", h, q + 2 * kv), Linear("o_proj", q, h)]

    def dense_mlp(self) -> list[Linear]:
        return [Linear("gate_up", self.hidden, 2 * self.dense_inter),
                Linear("down", self.dense_inter, self.hidden)]

    def shared_mlp(self) -> list[Linear]:
        if not self.shared_experts:
            return []
        inter = self.moe_inter * self.shared_experts
        return [Linear("shared_gate_up", self.hidden, 2 * inter),
                Linear("shared_down", inter, self.hidden)]

    def lm_head(self) -> Linear:
        return Linear("lm_head", self.hidden, self.vocab, fp8=False)

    def kv_bytes_per_token(self, elt: int = 2) -> int:
        """KV cache bytes of one token over all layers (MLA: latent + rope; GQA: K and V)."""
        if self.attention == "mla":
            return self.layers * (self.kv_lora + self.rope_dim) * elt
        return self.layers * 2 * self.kv_heads * self.head_dim * elt

    def expert_bytes(self, dtype: str) -> int:
        """One routed expert's weights (gate, up, down), FP8 with 128x128 block scales."""
        elems = 3 * self.hidden * self.moe_inter
        return elems + elems // (128 * 128) * 4 if dtype == "fp8" else 2 * elems


def _get(c: Any, *names: str, default: Any = 0) -> Any:
    for n in names:
        v = getattr(c, n, None)
        if v is not None:
            return v
    return default


def shape_from_config(name: str, c: Any) -> ModelShape:
    """A ModelShape from a transformers config (DeepSeek-V2/V3, Qwen3-MoE/Mixtral, Llama/Qwen)."""
    layers = c.num_hidden_layers
    experts = _get(c, "n_routed_experts", "num_experts", "num_local_experts")
    if getattr(c, "n_routed_experts", None):
        first = _get(c, "first_k_dense_replace")
        freq = _get(c, "moe_layer_freq", default=1) or 1
        moe = sum(1 for i in range(layers) if i >= first and i % freq == 0)
    else:
        moe = layers if experts else 0
    mla = bool(getattr(c, "kv_lora_rank", None))
    heads = c.num_attention_heads
    head_dim = (c.qk_nope_head_dim + c.qk_rope_head_dim if mla
                else _get(c, "head_dim") or c.hidden_size // heads)
    quant = getattr(c, "quantization_config", None) or {}
    return ModelShape(
        name=name, hidden=c.hidden_size, layers=layers, moe_layers=moe, vocab=c.vocab_size,
        attention="mla" if mla else "gqa", heads=heads,
        kv_heads=1 if mla else _get(c, "num_key_value_heads", default=heads),
        head_dim=head_dim, v_head_dim=_get(c, "v_head_dim") if mla else head_dim,
        kv_lora=_get(c, "kv_lora_rank"), rope_dim=_get(c, "qk_rope_head_dim") if mla else 0,
        q_lora=_get(c, "q_lora_rank"), dense_inter=c.intermediate_size, experts=experts,
        topk=_get(c, "num_experts_per_tok"), moe_inter=_get(c, "moe_intermediate_size"),
        shared_experts=_get(c, "n_shared_experts"), groups=_get(c, "n_group", default=1) or 1,
        topk_groups=_get(c, "topk_group", default=1) or 1,
        mtp_layers=_get(c, "num_nextn_predict_layers"),
        fp8_checkpoint=(quant.get("quant_method") == "fp8"
                        if isinstance(quant, dict) else False))


@lru_cache(maxsize=16)
def load_config(name_or_path: str, layers: int | None = None) -> Any:
    """The model's config: a shipped shape (`tools.make_random --shape` names: deepseek_v3,
    qwen3_30b_a3b, llama3_8b, deepseek_v2_lite; its fields as make_random writes them, without
    importing transformers) or an HF folder's config.json; `layers` cuts the model as
    `make_random --layers` does."""
    from types import SimpleNamespace

    from moeserve.tools.make_random import SHAPES, VOCAB_SIZE

    if name_or_path in SHAPES:
        kwargs = {**SHAPES[name_or_path][1], "vocab_size": VOCAB_SIZE,
                  "tie_word_embeddings": False}
        if layers is not None:
            kwargs["num_hidden_layers"] = layers
        return SimpleNamespace(**kwargs)
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(name_or_path)
    if layers is not None:
        c.num_hidden_layers = layers
    return c


def load_shape(name_or_path: str, layers: int | None = None) -> ModelShape:
    """The ModelShape of `load_config(name_or_path, layers)`."""
    name = name_or_path.rstrip("/").split("/")[-1]
    return shape_from_config(name, load_config(name_or_path, layers))
