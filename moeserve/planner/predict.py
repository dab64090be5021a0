"""A deployment's predicted throughput, latencies and memory, role by role.

Prefill role: each GPU runs steps of `chunk` new tokens; input tok/s = chunk / step, TTFT = the
steps a prompt needs plus moving its KV to decode over the NIC (queueing not modelled).
Decode role: each GPU runs `batch` requests; a step verifies 1 + MTP-steps tokens per request
(and runs the MTP layer that many times), emits `accept_len` tokens per request, so
ITL = step / accept_len and output tok/s = batch x accept_len / step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from moeserve.planner.arch import ModelShape, load_shape
from moeserve.planner.costs import CostModel
from moeserve.planner.deploy import Deployment, Role
from moeserve.planner.memory import MemoryPlan, role_memory
from moeserve.planner.profiles import HardwareProfile, load_profile
from moeserve.planner.step import Breakdown, StepInput, step
from moeserve.planner.workload import Workload, step_balancedness


@dataclass
class RolePrediction:
    role: Role
    breakdown: Breakdown
    step_ms: float
    tok_s_gpu: float  # input tokens (prefill) or output tokens (decode, colocated)
    latency_ms: float  # TTFT (prefill) or ITL (decode)
    balance: float
    memory: MemoryPlan

    @property
    def tok_s_node(self) -> float:
        return self.tok_s_gpu * self.role.gpus_per_node

    @property
    def fits(self) -> bool:
        return self.memory.fits


@dataclass
class Prediction:
    deployment: Deployment
    workload: Workload
    roles: list[RolePrediction]

    def role(self, kind: str) -> RolePrediction:
        return next(r for r in self.roles if r.role.kind == kind)

    @property
    def fits(self) -> bool:
        return all(r.fits for r in self.roles)

    @property
    def itl_ms(self) -> float:
        return self.role("decode" if self.deployment.decode else "colocated").latency_ms

    @property
    def output_tok_s_gpu(self) -> float:
        return self.role("decode" if self.deployment.decode else "colocated").tok_s_gpu

    def sources(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.roles:
            for k, v in r.breakdown.source_summary().items():
                out[k] = out.get(k, 0) + v
        return out


def balance_of(s: ModelShape, role: Role, w: Workload, tokens_per_gpu: int) -> float:
    if not s.is_moe or role.ep_size <= 1:
        return 1.0
    nodes = max(1, math.ceil(role.ep_size / role.gpus_per_node))
    return step_balancedness(w.popularity, s.experts, s.topk, s.groups, role.ep_size,
                             role.redundant, nodes, max(tokens_per_gpu, 1), role.eplb, w.seed)


def _effective(s: ModelShape, role: Role) -> Role:
    """Redundant slots only mean something across several EP ranks."""
    return role.with_(redundant=0) if (role.ep_size <= 1 or not s.is_moe) else role


def predict_prefill(s: ModelShape, c: CostModel, role: Role, w: Workload, dtype: str,
                    model: str) -> RolePrediction:
    role = _effective(s, role)
    new = max(w.new_prefill_tokens, 1.0)
    tokens = role.chunk
    bal = balance_of(s, role, w, tokens)
    x = StepInput("prefill", tokens, tokens / new, 0.0, new=min(new, tokens),
                  prefix=w.input_len * w.prefix_hit, balance=bal, logits=tokens / new)
    b = step(s, c, role, x, dtype)
    ms = b.total_us / 1e3
    kv_ms = w.input_len * s.kv_bytes_per_token() / (c.profile.nic_gbps.value * 1e9) * 1e3
    ttft = ms * math.ceil(new / tokens) + kv_ms
    mem = role_memory(model, s, c.profile, role, dtype, w.input_len)
    return RolePrediction(role, b, ms, tokens / ms * 1e3, ttft, bal, mem)


def predict_decode(s: ModelShape, c: CostModel, role: Role, w: Workload, dtype: str,
                   model: str) -> RolePrediction:
    role = _effective(s, role)
    tokens = role.batch * (1 + role.mtp_steps)
    bal = balance_of(s, role, w, tokens)
    context = w.input_len + w.output_len / 2
    x = StepInput("decode", tokens, role.batch, context, balance=bal, logits=tokens)
    b = step(s, c, role, x, dtype)
    if role.mtp_steps:  # the draft passes: one MoE layer + the LM head per draft step
        one = replace(s, layers=1, moe_layers=1 if s.is_moe else 0)
        draft = step(one, c, role, replace(x, tokens=role.batch, logits=role.batch), dtype)
        for part, us in draft.parts.items():
            b.parts[part] += us * role.mtp_steps
    ms = b.total_us / 1e3
    accept = role.accept_len if role.mtp_steps else 1.0
    mem = role_memory(model, s, c.profile, role, dtype, w.input_len + w.output_len)
    return RolePrediction(role, b, ms, role.batch * accept / ms * 1e3, ms / accept, bal, mem)


def predict(dep: Deployment, w: Workload, costs: CostModel | None = None,
            layers: int | None = None) -> Prediction:
    """Price every role of `dep` on `w`. `layers` cuts the model (the benchmark cuts)."""
    prof: HardwareProfile = load_profile(dep.profile)
    c = costs or CostModel(prof, dep.kernels)
    s = load_shape(dep.model, layers)
    roles = []
    if dep.colocated:
        r = dep.colocated
        roles.append(replace(predict_decode(s, c, r.with_(kind="decode"), w, dep.dtype,
                                            dep.model), role=r))
    else:
        roles.append(predict_prefill(s, c, dep.prefill, w, dep.dtype, dep.model))
        roles.append(predict_decode(s, c, dep.decode, w, dep.dtype, dep.model))
    return Prediction(dep, w, roles)
