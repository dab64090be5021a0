"""Sparse MoE models with GQA attention: Qwen3-MoE and Mixtral."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from moeserve.layers.moe import MoEExperts
from moeserve.layers.router import RouterConfig, select_experts
from moeserve.models.llama import MLP, CausalLM, DecoderLayer, DecoderModel


class SparseMoeBlock(nn.Module):
    """Router → top-k → experts. Parameter names follow the checkpoint (`gate`, `experts`)."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int,
                 router: RouterConfig):
        super().__init__()
        self.router = router
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = MoEExperts(num_experts, hidden_size, intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(self.gate(x), self.router)  # [T, K] each
        return self.experts(x, ids, weights)


def _is_moe_layer(cfg: Any, i: int) -> bool:
    sparse_step = getattr(cfg, "decoder_sparse_step", 1) or 1
    dense = set(getattr(cfg, "mlp_only_layers", None) or [])
    return i not in dense and cfg.num_experts > 0 and (i + 1) % sparse_step == 0


class Qwen3MoeForCausalLM(CausalLM):
    expert_weight_names = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}

    def __init__(self, cfg: Any):
        router = RouterConfig(top_k=cfg.num_experts_per_tok, renormalize=cfg.norm_topk_prob)

        def make_layer(i: int) -> DecoderLayer:
            if _is_moe_layer(cfg, i):
                mlp = SparseMoeBlock(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts,
                                     router)
            else:
                mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
            return DecoderLayer(cfg, i, mlp, qk_norm=True)

        super().__init__(cfg, DecoderModel(cfg, make_layer))


class MixtralForCausalLM(CausalLM):
    """Mixtral names the MoE block `block_sparse_moe` and its projections w1 (gate), w3 (up), w2."""

    expert_weight_names = {"w1": "gate", "w3": "up", "w2": "down"}

    def __init__(self, cfg: Any):
        router = RouterConfig(top_k=cfg.num_experts_per_tok, renormalize=True)

        def make_layer(i: int) -> DecoderLayer:
            moe = SparseMoeBlock(cfg.hidden_size, cfg.intermediate_size, cfg.num_local_experts,
                                 router)
            return DecoderLayer(cfg, i, moe, mlp_name="block_sparse_moe")

        super().__init__(cfg, DecoderModel(cfg, make_layer))
