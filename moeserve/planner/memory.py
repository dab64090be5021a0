"""Memory per GPU of a role: weights (the FP8 planner's numbers, `tools.plan_memory.plan_rank`,
so the planner and the runtime's start-up plan agree), the KV its batch holds, and activations
of its largest step; a plan that does not fit is refused with the numbers."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

from moeserve.planner.arch import ModelShape, load_config
from moeserve.planner.deploy import Role
from moeserve.planner.profiles import HardwareProfile
from moeserve.tools.plan_memory import GIB, plan_rank

MEM_FRACTION = 0.85  # cache.mem_fraction_static's default: weights + KV


@dataclass(frozen=True)
class MemoryPlan:
    weights: float  # bytes
    kv: float  # bytes the role's requests hold at once
    activations: float  # bytes of the largest step's intermediates
    budget: float  # mem_fraction_static of the GPU
    kv_capacity_tokens: int  # tokens of KV that fit beside the weights

    @property
    def total(self) -> float:
        return self.weights + self.kv + self.activations

    @property
    def fits(self) -> bool:
        return self.total <= self.budget

    def describe(self) -> str:
        return (f"weights {self.weights / GIB:.1f} GiB + KV {self.kv / GIB:.1f} GiB + activations "
                f"{self.activations / GIB:.1f} GiB = {self.total / GIB:.1f} GiB of a "
                f"{self.budget / GIB:.1f} GiB budget ({MEM_FRACTION:.0%} of the GPU)")


def role_memory(model: str, s: ModelShape, prof: HardwareProfile, role: Role, dtype: str,
                tokens_per_request: float, layers: int | None = None) -> MemoryPlan:
    """One GPU of `role`: weights as plan_memory counts them for this EP size and redundancy,
    KV for its requests (decode: batch x tokens_per_request; prefill: one chunk), and the
    activations of its biggest step (the dispatched expert rows dominate under EP)."""
    cfg = SimpleNamespace(
        model=SimpleNamespace(load_mtp=role.mtp_steps > 0, fp8_lm_head=False),
        eplb=SimpleNamespace(num_redundant_experts=role.redundant if s.is_moe else 0),
        parallel=SimpleNamespace(ep=role.ep_size if s.is_moe else 1, dp_size=role.gpus),
        cache=SimpleNamespace(mem_fraction_static=MEM_FRACTION))
    gpu = prof.hbm_gib.value * GIB
    rank = plan_rank(cfg, load_config(model, layers), dtype, int(gpu))
    if role.kind == "prefill":
        tokens = role.chunk
        kv = tokens * s.kv_bytes_per_token()
    else:
        tokens = role.batch * (1 + role.mtp_steps)
        kv = role.batch * tokens_per_request * s.kv_bytes_per_token()
    # hidden states, the widest projection's output and the dispatched expert rows
    # (topk rows per token, each 2 x moe_inter wide then hidden wide), bf16
    widest = max([lin.n for lin in s.attention_linears(prefill=True)] + [2 * s.dense_inter])
    expert_rows = tokens * max(s.topk, 1) * (2 * s.moe_inter + s.hidden) if s.is_moe else 0
    activations = 2.0 * (tokens * (4 * s.hidden + widest) + expert_rows)
    return MemoryPlan(rank.weights, kv, activations, rank.budget,
                      max(rank.budget - rank.weights - activations, 0) // s.kv_bytes_per_token())
