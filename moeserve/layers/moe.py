"""Routed experts: stacked gate/up and down weights and the grouped expert computation.

`MoEExperts` holds the experts this rank owns ([local_experts, ...] stacks) and computes
sum_k w[t, k] * expert_{ids[t, k]}(x[t]) for tokens already routed to it. Dispatch and combine across
expert-parallel ranks wrap around this module (moe_stages.py), and where the experts live is
moe_parallel.py's; the math here is the torch reference.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from moeserve.kernels.cpu.ops import CpuKernels
from moeserve.kernels.slot_counts import count_per_expert
from moeserve.layers.activation import silu_and_mul

GATE, UP, DOWN = "gate", "up", "down"
_HAS_GROUPED_MM = hasattr(torch, "_grouped_mm")
# On CPU each expert group of a grouped GEMM costs 15-50 µs of dispatch; up to this many
# multiply-adds (tokens x local experts x 3HI, ~0.2 ms on 2 cores) running every local expert on
# every token is faster (hidden 64, 8 experts, 16 tokens: 0.38 -> 0.14 ms).
CPU_DENSE_MAX_MACS = 1 << 24


class MoEExperts(nn.Module):
    """Experts [first_expert, first_expert + num_local) of num_experts.

    w13: [E_local, 2I, H] laid out as [gate | up]; w2: [E_local, H, I].
    """

    cpu_kernels: CpuKernels | None = None  # set on CPU models (kernels/cpu/ops.py): small batches
    gpu_ops: Any = None  # TritonOps on CUDA models: its `pdl` flag applies to the fused MoE

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 first_expert: int = 0, num_local: int | None = None,
                 slot_logical: list[int] | None = None, backend: str = "torch",
                 config_dir: str | None = None):
        """num_experts counts physical slots; `slot_logical[i]` is the checkpoint (logical)
        expert whose weights local slot i holds (default: slot first_expert + i). backend:
        torch | triton (fused-MoE kernels, launch configs from config_dir or the shipped ones);
        "auto" is resolved by the runner before it gets here."""
        super().__init__()
        self.backend = backend
        self.config_dir = config_dir
        self.num_experts = num_experts
        self.first_expert = first_expert
        self.num_local = num_experts if num_local is None else num_local
        self.intermediate_size = intermediate_size
        self.slot_logical = slot_logical or list(range(first_expert, first_expert + self.num_local))
        self.create_weights(hidden_size, intermediate_size)

    def create_weights(self, hidden_size: int, intermediate_size: int) -> None:
        """The stacked weights in the default dtype (layers/fp8_moe.py: FP8 + block scales)."""
        self.w13 = nn.Parameter(torch.empty(self.num_local, 2 * intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(self.num_local, hidden_size, intermediate_size))
        self.expect_shards(self.w13, self.w2)

    def expect_shards(self, w13: nn.Parameter, w2: nn.Parameter) -> None:
        """Route checkpoint tensors of [gate | up] into w13-shaped stacks, down into w2's."""
        w13.weight_loader = w2.weight_loader = self.weight_loader
        w13.expected_shards = {(e, s) for e in self.slot_logical for s in (GATE, UP)}
        w2.expected_shards = {(e, DOWN) for e in self.slot_logical}

    def expert_params(self) -> list[nn.Parameter]:
        """Every tensor stacked per local slot ([E_local, ...]): what an EPLB move copies."""
        return [self.w13, self.w2]

    def stacked_weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 [E_local, 2I, H], w2 [E_local, H, I]) in `dtype`, for batched expert GEMMs."""
        return self.w13.to(dtype), self.w2.to(dtype)

    def forward_per_expert(self, x: torch.Tensor) -> torch.Tensor:
        """x [E_local, M, H], row block e for local expert e → its UNweighted MLP [E_local, M, H]
        (the low-latency dispatch layout; padding rows are computed too)."""
        w13, w2 = self.stacked_weights(x.dtype)
        h = silu_and_mul(torch.bmm(x, w13.transpose(1, 2)))  # [E_local, M, I]
        return torch.bmm(h, w2.transpose(1, 2))  # [E_local, M, H]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, expert_id: int,
                      shard: str) -> None:
        """Load one checkpoint tensor of logical expert `expert_id` into every local slot that
        holds it (redundant replicas get copies); experts held only elsewhere are skipped."""
        i = self.intermediate_size
        for local, logical in enumerate(self.slot_logical):
            if logical != expert_id:
                continue
            dest = {GATE: param.data[local, :i], UP: param.data[local, i:],
                    DOWN: param.data[local]}[shard]
            if dest.shape != loaded.shape:
                raise ValueError(f"expert {expert_id} {shard}: expected {tuple(dest.shape)}, "
                                 f"got {tuple(loaded.shape)}")
            dest.copy_(loaded)

    @property
    def all_local(self) -> bool:
        """Every expert id is a local slot (one EP rank): no id needs masking or remapping."""
        return self.first_expert == 0 and self.num_local >= self.num_experts

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
        """x: [T, H]; topk_ids/weights: [T, K] (global expert ids; non-local ids contribute 0)."""
        if self.backend == "triton":
            return self.forward_triton(x, topk_ids, topk_weights)
        macs = x.shape[0] * self.num_local * 3 * x.shape[1] * self.intermediate_size
        if x.device.type == "cpu" and macs <= CPU_DENSE_MAX_MACS:
            if self.cpu_kernels is not None and x.dtype == self.w13.dtype:
                return self.cpu_kernels.moe_experts(x, topk_ids, topk_weights, self.w13, self.w2,
                                                    self.first_expert)
            return self.forward_dense(x, topk_ids, topk_weights)
        if _HAS_GROUPED_MM and (x.device.type == "cpu" or x.dtype == torch.bfloat16):
            return self.forward_grouped(x, topk_ids, topk_weights)
        if x.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # NOTE: forward_loop reads the per-expert counts on the host, which a CUDA graph
            # cannot capture (float32/float16: no grouped GEMM); the dense form has no host read
            return self.forward_dense(x, topk_ids, topk_weights)
        return self.forward_loop(x, topk_ids, topk_weights)

    def forward_triton(self, x: torch.Tensor, topk_ids: torch.Tensor,
                       topk_weights: torch.Tensor) -> torch.Tensor:
        """The fused-MoE Triton kernels (imported here: torch-only runs never import Triton)."""
        from moeserve.kernels.triton.fused_moe import fused_moe
        from moeserve.kernels.triton.moe_config import get_moe_config

        cfg = get_moe_config(self.num_local, x.shape[1], self.intermediate_size,
                             topk_ids.shape[1], x.dtype, x.shape[0], self.config_dir)
        return fused_moe(x, self.w13, self.w2, topk_ids, topk_weights, self.first_expert,
                         self.num_local, cfg, pdl=self.pdl)

    @property
    def pdl(self) -> bool:
        return self.gpu_ops is not None and self.gpu_ops.pdl

    def forward_grouped(self, x: torch.Tensor, topk_ids: torch.Tensor,
                        topk_weights: torch.Tensor) -> torch.Tensor:
        """All local experts in two grouped GEMMs, with no host synchronisation."""
        t, k = topk_ids.shape
        if self.all_local:
            key = topk_ids.flatten()  # [T*K]
        else:
            local = (topk_ids - self.first_expert).flatten()  # [T*K]
            valid = (local >= 0) & (local < self.num_local)
            key = torch.where(valid, local, self.num_local)  # non-local pairs sort last
        order = key.argsort(stable=True)
        offs = count_per_expert(key, self.num_local).cumsum(0).to(torch.int32)  # group ends
        token_of = order // k
        xs = x.index_select(0, token_of)  # [T*K, H] grouped by expert
        h = silu_and_mul(torch._grouped_mm(xs, self.w13.transpose(1, 2), offs=offs))
        y = torch._grouped_mm(h, self.w2.transpose(1, 2), offs=offs)  # [T*K, H]
        w = topk_weights.flatten()[order]
        if self.all_local:
            y = y.float() * w.float()[:, None]
        else:
            w = (w * valid[order]).float()
            y = torch.where(valid[order, None], y.float(), 0.0) * w[:, None]  # past offs[-1]: 0
        out = torch.zeros((t, x.shape[1]), dtype=torch.float32, device=x.device)
        out.index_add_(0, token_of, y)
        return out.to(x.dtype)

    def forward_dense(self, x: torch.Tensor, topk_ids: torch.Tensor,
                      topk_weights: torch.Tensor) -> torch.Tensor:
        """Every local expert on every token, combined with the routing weights (0 where an expert
        was not chosen): E/K times the FLOPs of routing, in three batched ops for tiny experts.
        NOTE: an unchosen expert's output is multiplied by 0, so only an infinite one could leak."""
        t, h = x.shape
        e, i = self.num_local, self.intermediate_size
        if self.all_local:
            local = topk_ids
        else:
            local = topk_ids - self.first_expert  # [T, K]
            local = torch.where((local >= 0) & (local < e), local, e)  # non-local → column e
        dense_w = torch.zeros((t, e + 1), dtype=torch.float32, device=x.device)
        dense_w.scatter_add_(1, local, topk_weights.float())  # [T, E+1]
        gate_up = torch.matmul(x, self.w13.view(e * 2 * i, h).t()).view(t, e, 2 * i)  # [T, E, 2I]
        y = torch.bmm(silu_and_mul(gate_up).transpose(0, 1), self.w2.transpose(1, 2))  # [E, T, H]
        out = torch.bmm(dense_w[:, None, :e], y.float().transpose(0, 1))  # [T, 1, H]
        return out.view(t, h).to(x.dtype)

    def forward_loop(self, x: torch.Tensor, topk_ids: torch.Tensor,
                     topk_weights: torch.Tensor) -> torch.Tensor:
        """Reference: one pair of GEMMs per expert that received tokens."""
        out = torch.zeros_like(x, dtype=torch.float32)
        local_ids = topk_ids - self.first_expert
        flat_ids = local_ids.flatten()  # [T*K]
        order = flat_ids.argsort(stable=True)
        counts = torch.bincount(flat_ids.clamp(0, self.num_local).masked_fill(
            (flat_ids < 0) | (flat_ids >= self.num_local), self.num_local), minlength=self.num_local + 1)
        token_of = order // topk_ids.shape[1]
        weight_of = topk_weights.flatten()[order]
        start = int((flat_ids < 0).sum())
        for e, n in enumerate(counts[: self.num_local].tolist()):
            if n == 0:
                continue
            tok, w = token_of[start : start + n], weight_of[start : start + n]
            h = silu_and_mul(x[tok] @ self.w13[e].t()) @ self.w2[e].t()  # [n, H]
            out.index_add_(0, tok, h.float() * w[:, None].float())
            start += n
        return out.to(x.dtype)
