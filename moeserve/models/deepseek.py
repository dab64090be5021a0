"""DeepSeek-V2 / V3: multi-head latent attention (MLA) + grouped top-k MoE with shared experts.

Decode (and short extend) steps run MLA weight-absorbed, as MQA over one latent per token
(docs/architecture.md §5):
  latent  = [kv_a_layernorm(c_kv) | rope(k_pe)]              [T, 1, R + r]  (the KV pool entry)
  q       = [q_nope @ W_UK (per head) | rope(q_pe)]          [T, H, R + r]
  out     = softmax(q · latent) · latent[:R] @ W_UV          [T, H, v_head_dim]
where kv_b_proj.weight = [H, nope + v, R] holds W_UK (first `nope` rows per head) and W_UV.
In exact arithmetic this equals the non-absorbed attention of the paper (and of transformers).
Prefill and long extend steps (ForwardBatch.mla_mha_chunk > 0) run that MHA form instead, with
K/V decompressed from the latent cache by chunks (attention/mla_mha.py, docs/mla.md).

Checkpoints may carry one NextN (MTP) layer as `model.layers.{num_hidden_layers}.*`; with
`load_mtp=True` it is built as the last entry of `model.layers` (so names match) but the main
forward stops before it.
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from moeserve.attention.mla_mha import MlaShape
from moeserve.forward_batch import ForwardBatch
from moeserve.layers.attention import PagedAttention
from moeserve.layers.linear import Linear, MergedLinear
from moeserve.layers.moe_parallel import MoEParallel
from moeserve.layers.moe_stages import run_routed_experts
from moeserve.layers.norm import RMSNorm
from moeserve.layers.rotary import get_rope, rope_parameters
from moeserve.layers.router import RouterConfig, select_experts
from moeserve.layers.router_skew import routing_skew, skewed
from moeserve.models.llama import MLP, CausalLM, DecoderLayer, DecoderModel

if TYPE_CHECKING:  # importing it imports Triton
    from moeserve.kernels.triton.ops import TritonOps

LORA_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm use the default eps, not rms_norm_eps
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")
# NOTE: the MTP layer shares embedding and LM head with the target model; the checkpoint's copies
# under model.layers.{N}. are not loaded.
_MTP_SHARED = ("embed_tokens.weight", "shared_head.head.weight")
# With a q LoRA (V2 full, V3) the checkpoint's q_a_proj and kv_a_proj_with_mqa load into one
# `fused_qkv_a_proj` = [q_a | kv_a]: at decode batch 1 they were two GEMVs of the same x, each too
# small to stream at full bandwidth (DeepSeek-V3, H200: 7.9 + 4.7 µs in FP8, 8.5 + 5.4 in bf16).
QKV_A_PACKING = {"q_a_proj": ("fused_qkv_a_proj", "q_a"),
                 "kv_a_proj_with_mqa": ("fused_qkv_a_proj", "kv_a")}


def softmax_scale(cfg: Any) -> float:
    """1/sqrt(qk_head_dim), times mscale(factor, mscale_all_dim)² for YaRN-scaled ropes."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    rope = rope_parameters(cfg)
    mscale_all_dim = rope.get("mscale_all_dim") or 0
    factor = rope.get("factor") or 1.0
    if rope.get("rope_type", "default") != "default" and mscale_all_dim and factor > 1:
        mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


class MLAttention(nn.Module):
    gpu_ops: TritonOps | None = None  # set on CUDA models (kernels.triton.ops)

    def __init__(self, cfg: Any, layer_id: int):
        super().__init__()
        self.num_heads, self.kv_lora_rank = cfg.num_attention_heads, cfg.kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                                                    cfg.v_head_dim)
        h, bias, q_size = cfg.hidden_size, cfg.attention_bias, self.num_heads * (
            self.nope_dim + self.rope_dim)
        self.q_lora_rank = cfg.q_lora_rank
        kv_a = self.kv_lora_rank + self.rope_dim
        if self.q_lora_rank is None:
            self.q_proj = Linear(h, q_size, bias=False)
            self.kv_a_proj_with_mqa = Linear(h, kv_a, bias=bias)
        else:  # q_a and kv_a read the same x: one weight stream and one launch (QKV_A_PACKING)
            self.fused_qkv_a_proj = MergedLinear(h, [self.q_lora_rank, kv_a], ["q_a", "kv_a"],
                                                 bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LORA_NORM_EPS)
            self.q_b_proj = Linear(self.q_lora_rank, q_size, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LORA_NORM_EPS)
        self.kv_b_proj = Linear(self.kv_lora_rank, self.num_heads * (self.nope_dim + self.v_dim),
                                   bias=False)
        self.o_proj = Linear(self.num_heads * self.v_dim, h, bias=bias)
        self.register_buffer("kv_b_dense", None, persistent=False)  # after_load(), FP8 only
        # V2 rotates interleaved pairs (complex freqs); V3 too unless rope_interleave is False.
        interleaved = getattr(cfg, "rope_interleave", True)
        self.rotary = get_rope(cfg, self.rope_dim, cfg.max_position_embeddings,
                               is_neox_style=not interleaved)
        self.attn = PagedAttention(layer_id, self.num_heads, 1, self.kv_lora_rank + self.rope_dim,
                                   softmax_scale(cfg), v_head_dim=self.kv_lora_rank)
        self.mla_shape = MlaShape(self.num_heads, self.nope_dim, self.rope_dim, self.v_dim,
                                  self.kv_lora_rank)

    def _q_kv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """→ (q [T, H * (nope + r)], kv_a's output [T, R + r], rows possibly strided)."""
        if self.q_lora_rank is None:
            return self.q_proj(x), self.kv_a_proj_with_mqa(x)
        q_a, kv = self.fused_qkv_a_proj(x).split(
            [self.q_lora_rank, self.kv_lora_rank + self.rope_dim], dim=-1)
        return self.q_b_proj(self.q_a_layernorm(q_a)), kv

    def forward(self, x: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        return self.output(self.core(self.prepare(x, positions, fb), fb))

    def _w_kv(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj's weight [H * (nope + v), R] as views (W_UK [H, nope, R], W_UV [H, v, R])."""
        w_kv = weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        return w_kv.split([self.nope_dim, self.v_dim], dim=1)

    def _absorbed(self, x: torch.Tensor, part: int) -> torch.Tensor:
        """The per-head products of weight absorption: q_nope [T, H, nope] @ W_UK[h] → [T, H, R]
        (part 0), or the attention output [T, H, R] @ W_UV[h]^T → [T, H, v] (part 1). One decode
        token runs the per-head GEMV (on kv_b_proj's e4m3 bytes and block scales where it is
        FP8-resident); more tokens an einsum (on the dequantized weight)."""
        kv_b = self.kv_b_proj
        scale = getattr(kv_b, "weight_scale_inv", None)  # an Fp8Linear
        ops = self.gpu_ops if self.gpu_ops is not None and self.gpu_ops.usable(x) else None
        if ops is not None:
            out = ops.head_gemv(x, self._w_kv(kv_b.weight)[part], k_major=part == 0,
                                w_scale=scale, block=None if scale is None else kv_b.block)
            if out is not None:
                return out
        weight = kv_b.weight if scale is None else self.kv_b_dense
        if weight is None:  # FP8 and no after_load() (a module used on its own)
            weight = kv_b.dequantized()
        eq = "thn,hnr->thr" if part == 0 else "thr,hvr->thv"
        return torch.einsum(eq, x, self._w_kv(weight.to(x.dtype))[part])

    def after_load(self) -> None:
        """With kv_b_proj FP8-resident: its dequantized copy in the model dtype, for the einsums
        of more than one token, which the per-head FP8 GEMV does not serve (dequantizing per
        call put DeepSeek-V3's 7-layer cut's batch-64 decode step at 14.00 ms, 11.36 with the
        copy; H200). A buffer, so weight_bytes counts it: +16.8M model-dtype elements a layer
        on V3."""
        kv_b = self.kv_b_proj
        dense = kv_b.dequantized().to(self.kv_a_layernorm.weight.dtype) \
            if hasattr(kv_b, "weight_scale_inv") else None
        self.kv_b_dense = dense

    # The three stages of the op list (DecoderLayer.operations): projections, backend, output.
    def prepare(self, x: torch.Tensor, positions: torch.Tensor,
                fb: ForwardBatch | None = None) -> tuple:
        """→ (q, latent [T, 1, R + r], kv_stored, mha): q absorbed [T, H, R + r], or per head
        [T, H, nope + r] where fb runs the MHA form (mha); kv_stored: the GPU kernel also wrote
        the latent into fb's KV pool, else the backend stores it."""
        q, kv = self._q_kv(x)  # kv: [T, R + r]
        q = q.view(-1, self.num_heads, self.nope_dim + self.rope_dim)
        ops = self.gpu_ops if self.gpu_ops is not None and self.gpu_ops.usable(q) else None
        store = None
        if ops is not None and q.stride(2) == 1 and kv.stride(1) == 1 \
                and q.dtype == kv.dtype == self.kv_a_layernorm.weight.dtype:
            store = None if fb is None else self.attn.store_target(fb, kv.dtype)
            latent = ops.mla_rope_norm(q, kv, positions, self.rotary.cos_sin_cache,
                                       not self.rotary.is_neox_style, self.kv_a_layernorm.weight,
                                       self.kv_a_layernorm.eps, store)  # q's rope in place
            q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        else:
            q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)  # [T, H, nope], [., r]
            c_kv, k_pe = kv.split([self.kv_lora_rank, self.rope_dim], dim=-1)
            q_pe, k_pe = self.rotary(positions, q_pe, k_pe[:, None])  # k_pe: [T, 1, r]
            latent = torch.cat([self.kv_a_layernorm(c_kv)[:, None], k_pe], dim=-1)  # [T, 1, R+r]
        if fb is not None and fb.mla_mha_chunk:  # the MHA form: q stays per head
            if ops is None:
                q = torch.cat([q_nope, q_pe], dim=-1)  # [T, H, nope + r], roped
            return q, latent, store is not None, True
        q_lat = self._absorbed(q_nope, 0)  # [T, H, R]
        return torch.cat([q_lat, q_pe], dim=-1), latent, store is not None, False

    def core(self, q_latent: tuple, fb: ForwardBatch) -> torch.Tensor:
        """→ [T, H * R] (absorbed: the latent-space output) or [T, H, v] (MHA form)."""
        q, latent, kv_stored, mha = q_latent
        if mha:
            return self.attn.forward_mla_mha(q, latent, fb, self.kv_b_proj, self.mla_shape,
                                             kv_stored=kv_stored)
        return self.attn(q, latent, None, fb, kv_stored=kv_stored)  # [T, H * R]

    def output(self, out: torch.Tensor) -> torch.Tensor:
        if out.dim() == 3:  # the MHA form's [T, H, v]
            return self.o_proj(out.flatten(1))
        v = self._absorbed(out.view(-1, self.num_heads, self.kv_lora_rank), 1)  # [T, H, v]
        return self.o_proj(v.flatten(1))  # [T, hidden]


class MoEGate(nn.Module):
    """Router: `weight` [E, hidden] and (V3) `e_score_correction_bias` [E], both float32."""

    gpu_ops: TritonOps | None = None  # set on CUDA models (kernels.triton.ops)

    def __init__(self, hidden_size: int, num_experts: int, with_bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32))
        self.e_score_correction_bias = nn.Parameter(
            torch.zeros(num_experts, dtype=torch.float32), requires_grad=False
        ) if with_bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = self.gpu_ops
        if ops is not None and ops.usable(x):
            logits = ops.router_logits(x, self.weight)  # decode: one launch, x not cast
            if logits is not None:
                return logits
        return F.linear(x.float(), self.weight)  # [T, E] float32 logits


class DeepseekMoE(nn.Module):
    """Routed experts (grouped top-k) plus always-on shared experts."""

    gpu_ops: TritonOps | None = None  # set on CUDA models (kernels.triton.ops): the router

    def __init__(self, cfg: Any, router: RouterConfig, layer_id: int,
                 parallel: MoEParallel | None = None):
        super().__init__()
        self.router, self.layer_id = router, layer_id
        self.parallel = parallel or MoEParallel()
        self.gate = MoEGate(cfg.hidden_size, cfg.n_routed_experts, router.scoring == "sigmoid")
        # None unless MOESERVE_TEST_ZIPF_ROUTER or _RANDOM_ROUTER is set (router_skew.py)
        self.logit_skew = routing_skew(cfg.n_routed_experts, layer_id, self.gate.weight.device)
        self.experts = self.parallel.make_experts(cfg.n_routed_experts, cfg.hidden_size,
                                                  cfg.moe_intermediate_size, layer_id)
        n_shared = cfg.n_shared_experts or 0
        self.shared_experts = (MLP(cfg.hidden_size, cfg.moe_intermediate_size * n_shared)
                               if n_shared else None)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """→ (weights, logical ids), [T, K] each."""
        logits = skewed(self.gate(x), self.logit_skew)
        ops = self.gpu_ops if self.gpu_ops is not None and self.gpu_ops.usable(logits) else None
        return select_experts(logits, self.router, self.gate.e_score_correction_bias, kernels=ops)

    def shared(self, x: torch.Tensor) -> torch.Tensor | None:
        return None if self.shared_experts is None else self.shared_experts(x)

    def forward(self, x: torch.Tensor, fb: ForwardBatch | None = None) -> torch.Tensor:
        weights, ids = self.route(x)
        out = run_routed_experts(self.experts, x, ids, weights, self.parallel, fb, self.layer_id)
        shared = self.shared(x)
        return out if shared is None else out + shared


class DeepseekDecoderLayer(DecoderLayer):
    def __init__(self, cfg: Any, layer_id: int, mlp: nn.Module):
        super().__init__(cfg, MLAttention(cfg, layer_id), mlp)


class SharedHead(nn.Module):
    """The MTP layer's final norm; its `head` is the target's lm_head (see _MTP_SHARED)."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.norm = RMSNorm(hidden_size, eps)


class DeepseekMTPLayer(DeepseekDecoderLayer):
    """NextN layer: eh_proj([enorm(embed(next ids)) | hnorm(target hidden)]) → decoder block →
    shared_head.norm. Parameter names follow the checkpoint's model.layers.{num_hidden_layers}.*."""

    def __init__(self, cfg: Any, layer_id: int, mlp: nn.Module):
        super().__init__(cfg, layer_id, mlp)
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.enorm, self.hnorm = RMSNorm(h, eps), RMSNorm(h, eps)
        self.eh_proj = Linear(2 * h, h, bias=False)
        self.shared_head = SharedHead(h, eps)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                fb: ForwardBatch) -> torch.Tensor:
        """embeds, hidden: [T, hidden] → draft hidden [T, hidden] (input of the LM head)."""
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        x, residual = super().forward(x, None, positions, fb)
        return self.shared_head.norm(x, residual)[0]


class DeepseekModel(DecoderModel):
    """DecoderModel whose `layers` may end with MTP layers; forward runs the main layers only."""

    def __init__(self, cfg: Any, make_layer, extra_layers: list[nn.Module]):
        super().__init__(cfg, make_layer)
        self.num_main_layers = cfg.num_hidden_layers
        self.layers.extend(extra_layers)

    def main_layers(self) -> list[nn.Module]:
        return list(self.layers[: self.num_main_layers])


def _is_moe_layer(cfg: Any, i: int) -> bool:
    freq = getattr(cfg, "moe_layer_freq", 1) or 1
    return bool(cfg.n_routed_experts) and i >= (cfg.first_k_dense_replace or 0) and i % freq == 0


class DeepseekV2ForCausalLM(CausalLM):
    has_mtp = True
    # NOTE: no q/k/v packing: V2's `q_proj` is a plain linear.
    packed_modules_mapping = {"gate_proj": ("gate_up_proj", "gate"),
                              "up_proj": ("gate_up_proj", "up")}
    expert_weight_names = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}

    @staticmethod
    def router_config(cfg: Any) -> RouterConfig:
        """Softmax scores; greedy or group-limited greedy (group score = max); no renormalization.

        NOTE: like transformers' DeepseekV2, norm_topk_prob is not applied (False in every released
        V2 checkpoint)."""
        if cfg.topk_method not in ("greedy", "group_limited_greedy"):
            raise ValueError(f"DeepSeek-V2 topk_method {cfg.topk_method!r} is not supported")
        grouped = cfg.topk_method == "group_limited_greedy"
        return RouterConfig(top_k=cfg.num_experts_per_tok, scoring="softmax", renormalize=False,
                            num_groups=cfg.n_group if grouped else 1,
                            topk_groups=cfg.topk_group if grouped else 1, group_score="max",
                            routed_scaling_factor=cfg.routed_scaling_factor)

    def __init__(self, cfg: Any, load_mtp: bool = False, parallel: MoEParallel | None = None):
        n, router = cfg.num_hidden_layers, self.router_config(cfg)
        if load_mtp and (getattr(cfg, "num_nextn_predict_layers", 0) or 0) != 1:
            raise ValueError("model.load_mtp=true needs num_nextn_predict_layers == 1 "
                             "in config.json")

        def make_mlp(i: int) -> nn.Module:
            return DeepseekMoE(cfg, router, i, parallel) if _is_moe_layer(cfg, i) else MLP(
                cfg.hidden_size, cfg.intermediate_size)

        mtp = [DeepseekMTPLayer(cfg, n, make_mlp(n))] if load_mtp else []
        model = DeepseekModel(cfg, lambda i: DeepseekDecoderLayer(cfg, i, make_mlp(i)), mtp)
        super().__init__(cfg, model)
        self.load_mtp = load_mtp
        if cfg.q_lora_rank is not None:
            self.packed_modules_mapping = {**self.packed_modules_mapping, **QKV_A_PACKING}

    @property
    def mtp(self) -> DeepseekMTPLayer:
        assert self.load_mtp, "built with load_mtp=False"
        return self.model.layers[self.config.num_hidden_layers]

    def forward_mtp(self, fb: ForwardBatch, hidden: torch.Tensor) -> torch.Tensor:
        """Draft hidden states [T, hidden] for fb's tokens given the target's hidden states at the
        previous positions; logits through compute_logits (the shared LM head)."""
        return self.mtp(self.model.embed_tokens(fb.input_ids), hidden, fb.positions, fb)

    def kv_layout(self) -> dict:
        c = self.config
        return {"kind": "mla", "layers": len(self.model.layers), "kv_lora_rank": c.kv_lora_rank,
                "rope_dim": c.qk_rope_head_dim}

    def skip_weight(self, name: str) -> bool:
        m = _LAYER_RE.match(name)
        if m and int(m[1]) >= self.config.num_hidden_layers:  # MTP layers
            mtp_layer = self.load_mtp and int(m[1]) == self.config.num_hidden_layers
            return not mtp_layer or name[m.end():] in _MTP_SHARED
        return super().skip_weight(name)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    @staticmethod
    def router_config(cfg: Any) -> RouterConfig:
        """Sigmoid scores + e_score_correction_bias for the choice; groups ranked by their top-2
        sum (noaux_tc, the only method transformers' DeepseekV3 implements)."""
        return RouterConfig(top_k=cfg.num_experts_per_tok, scoring="sigmoid",
                            renormalize=bool(cfg.norm_topk_prob), num_groups=cfg.n_group or 1,
                            topk_groups=cfg.topk_group or 1, group_score="top2_sum",
                            routed_scaling_factor=cfg.routed_scaling_factor)
