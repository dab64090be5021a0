"""Sparse MoE models with GQA attention: Qwen3-MoE and Mixtral."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from moeserve.forward_batch import ForwardBatch
from moeserve.kernels.cpu.ops import CpuKernels
from moeserve.layers.linear import Linear
from moeserve.layers.moe_parallel import MoEParallel
from moeserve.layers.moe_stages import run_routed_experts
from moeserve.layers.router import RouterConfig, select_experts
from moeserve.layers.router_skew import routing_skew, skewed
from moeserve.models.llama import MLP, Attention, CausalLM, DecoderLayer, DecoderModel

if TYPE_CHECKING:  # importing it imports Triton
    from moeserve.kernels.triton.ops import TritonOps


class SparseMoeBlock(nn.Module):
    """Router → top-k → experts. Parameter names follow the checkpoint (`gate`, `experts`)."""

    cpu_kernels: CpuKernels | None = None  # set on CPU models (kernels/cpu/ops.py)
    gpu_ops: TritonOps | None = None  # set on CUDA models (kernels.triton.ops)

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int,
                 router: RouterConfig, layer_id: int, parallel: MoEParallel | None = None):
        super().__init__()
        self.router, self.layer_id = router, layer_id
        self.parallel = parallel or MoEParallel()
        self.gate = Linear(hidden_size, num_experts, bias=False)
        # None unless MOESERVE_TEST_ZIPF_ROUTER or _RANDOM_ROUTER is set (router_skew.py)
        self.logit_skew = routing_skew(num_experts, layer_id, self.gate.weight.device)
        self.experts = self.parallel.make_experts(num_experts, hidden_size, intermediate_size,
                                                  layer_id)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """→ (weights, logical ids), [T, K] each. One token on CUDA: the router linear and its
        top-k in one launch (a batch-1 decode step is launch-bound)."""
        if self.gpu_ops is not None and x.shape[0] == 1 and self.gpu_ops.usable(x) \
                and type(self.gate) is Linear and self.gate.bias is None \
                and self.router.is_plain_softmax and self.logit_skew is None:
            fused = self.gpu_ops.router_topk(x, self.gate.weight, self.router.top_k,
                                             self.router.renormalize)
            if fused is not None:
                return fused
        logits = skewed(self.gate(x), self.logit_skew)
        kernels = self.cpu_kernels
        if kernels is None and self.gpu_ops is not None and self.gpu_ops.usable(logits):
            kernels = self.gpu_ops
        return select_experts(logits, self.router, kernels=kernels)

    def shared(self, x: torch.Tensor) -> None:
        return None  # no shared experts

    def forward(self, x: torch.Tensor, fb: ForwardBatch | None = None) -> torch.Tensor:
        weights, ids = self.route(x)
        return run_routed_experts(self.experts, x, ids, weights, self.parallel, fb, self.layer_id)


def _is_moe_layer(cfg: Any, i: int) -> bool:
    sparse_step = getattr(cfg, "decoder_sparse_step", 1) or 1
    dense = set(getattr(cfg, "mlp_only_layers", None) or [])
    return i not in dense and cfg.num_experts > 0 and (i + 1) % sparse_step == 0


class Qwen3MoeForCausalLM(CausalLM):
    expert_weight_names = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}

    def __init__(self, cfg: Any, parallel: MoEParallel | None = None):
        router = RouterConfig(top_k=cfg.num_experts_per_tok, renormalize=cfg.norm_topk_prob)

        def make_layer(i: int) -> DecoderLayer:
            if _is_moe_layer(cfg, i):
                mlp = SparseMoeBlock(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts,
                                     router, i, parallel)
            else:
                mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
            return DecoderLayer(cfg, Attention(cfg, i, qk_norm=True), mlp)

        super().__init__(cfg, DecoderModel(cfg, make_layer))


class MixtralForCausalLM(CausalLM):
    """Mixtral names the MoE block `block_sparse_moe` and its projections w1 (gate), w3 (up), w2."""

    expert_weight_names = {"w1": "gate", "w3": "up", "w2": "down"}

    def __init__(self, cfg: Any, parallel: MoEParallel | None = None):
        router = RouterConfig(top_k=cfg.num_experts_per_tok, renormalize=True)

        def make_layer(i: int) -> DecoderLayer:
            moe = SparseMoeBlock(cfg.hidden_size, cfg.intermediate_size, cfg.num_local_experts,
                                 router, i, parallel)
            return DecoderLayer(cfg, Attention(cfg, i), moe, mlp_name="block_sparse_moe")

        super().__init__(cfg, DecoderModel(cfg, make_layer))
