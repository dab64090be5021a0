"""The model of one step on one GPU: the sum of its kernels, layer by layer, with dispatch and
combine between them and two-batch overlap when it is on.

Decode: `tokens` = requests x (1 + MTP draft steps) query tokens over `context` cached tokens
each. Prefill: `tokens` new tokens per GPU, from prompts of `new` tokens over `prefix` cached.
Every part keeps the sources of its costs (costs.py), so a prediction says what it stands on.

Two-batch overlap is simulated, not assumed: the two micro-batches' ops run in the order the TBO
executor issues them (stage by stage, A then B) on one compute stream, their dispatches and
combines in that order on one network, each op after its own micro-batch's previous one. What
the network takes longer than the compute is exposed; what it takes less is hidden. DeepEP's
normal kernels hold `COMM_SMS` SMs while they run (SGLang's 96xH100 deployment: 24), so
compute overlapped with them runs on the remaining SMs.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from moeserve.planner.arch import ModelShape
from moeserve.planner.comm import CommSpec, dispatch_combine
from moeserve.planner.costs import Cost, CostModel
from moeserve.planner.deploy import Role

PARTS = ("attention", "gemm", "moe", "dispatch", "combine", "other", "tbo_hidden", "host")
COMM_SMS = 24
# Host time of one eager decoder layer in our runtime: a 5-layer Qwen3-30B-A3B decode step took
# 5.26 ms eager at batch 64 (docs/tbo.md), nearly all launch time
EAGER_HOST_US_PER_LAYER = 1050.0
# Small launches not priced apart, counted from the runtime's decode layer: GQA's q/k norm + rope
# (+ KV store); MLA's q_a norm, rope + latent norm + store, q concat; a MoE layer's EPLB
# recorder; a gated MLP's activation (dense MLP, shared experts) and the shared + routed add
GLUE = {"gqa": 1, "mla": 3}


@dataclass
class Breakdown:
    parts: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PARTS, 0.0))
    sources: dict[str, Counter] = field(default_factory=dict)

    def add(self, part: str, cost: Cost, times: float = 1.0) -> None:
        self.parts[part] += cost.us * times
        self.sources.setdefault(part, Counter())[cost.source] += 1

    @property
    def total_us(self) -> float:
        return sum(self.parts.values())

    def source_summary(self) -> dict[str, int]:
        out: Counter = Counter()
        for c in self.sources.values():
            out.update(c)
        return dict(out)


@dataclass(frozen=True)
class StepInput:
    kind: str  # decode | prefill
    tokens: int  # query tokens on this GPU
    requests: float  # requests these tokens belong to
    context: float  # decode: cached tokens per request
    new: float = 1.0  # prefill: new tokens per prompt
    prefix: float = 0.0  # prefill: cached tokens before them
    balance: float = 1.0  # step balancedness of the MoE layers
    logits: float = 0.0  # rows through the LM head


def _attention(s: ModelShape, c: CostModel, x: StepInput, dtype: str, t: int) -> tuple:
    """(core attention, projection GEMMs, small ops) of one layer for t tokens."""
    prefill = x.kind == "prefill"
    mha = prefill and s.attention == "mla" and c.kernels == "best"
    gemm = Cost(0.0, "measured")
    for lin in s.attention_linears(prefill=mha):
        gemm = gemm + c.gemm(t, lin.k, lin.n, dtype if lin.fp8 else "bf16")
    if s.attention == "mla" and not mha:
        gemm = gemm + c.absorb(t, s)
    share = t / max(x.tokens, 1)
    if prefill:
        core = c.attn_prefill(s, x.requests * share, x.new, x.prefix)
    else:
        core = c.attn_decode(s, t, x.context)
    other = c.norm(t, s.hidden).times(2) + c.glue(t, s.hidden).times(GLUE[s.attention])
    return core, gemm, other


def _moe_compute(s: ModelShape, c: CostModel, x: StepInput, dtype: str, t: int, ep: int,
                 slots: int) -> tuple[Cost, Cost, Cost]:
    """(routed experts, shared-expert GEMMs, router) of one MoE layer for t tokens per GPU."""
    pairs = t * s.topk / max(x.balance, 1e-3)  # the busiest GPU's
    local = slots / ep
    touched = local * (1 - math.exp(-pairs / local)) if local > 0 else 0.0
    experts = c.moe(s, dtype, touched, pairs)
    shared = Cost(0.0, "measured")
    for lin in s.shared_mlp():
        shared = shared + c.gemm(t, lin.k, lin.n, dtype)
    glue = c.glue(t, s.hidden).times(1 + (2 if s.shared_experts else 0))
    return experts, shared, c.router(t, s) + glue


def _dense_mlp(s: ModelShape, c: CostModel, dtype: str, t: int) -> Cost:
    out = c.glue(t, s.dense_inter)  # the activation
    for lin in s.dense_mlp():
        out = out + c.gemm(t, lin.k, lin.n, dtype)
    return out


def tbo_layer(pre: list[float], mid: list[float], post: list[float], disp: list[float],
              comb: list[float], t0: tuple[float, float, float]) -> tuple[float, float, float]:
    """One MoE layer of two micro-batches A, B on a compute stream and a network, in the
    executor's order. t0 = (compute free, network free, ...) -> the same after the layer.
    pre/mid/post/disp/comb: [A, B] durations (µs)."""
    comp, net, ready_b = t0
    ready = [comp, ready_b]  # when each micro-batch's previous op finished
    disp_end, comb_end = [0.0, 0.0], [0.0, 0.0]
    for m in (0, 1):  # attention + router, then dispatch
        comp = max(comp, ready[m]) + pre[m]
        start = max(net, comp)
        net = disp_end[m] = start + disp[m]
    for m in (0, 1):  # experts after own dispatch, then combine
        comp = max(comp, disp_end[m]) + mid[m]
        start = max(net, comp)
        net = comb_end[m] = start + comb[m]
    for m in (0, 1):  # shared experts and residual after own combine
        comp = max(comp, comb_end[m]) + post[m]
        ready[m] = comp
    return comp, net, ready[1]


def step(s: ModelShape, c: CostModel, role: Role, x: StepInput, dtype: str) -> Breakdown:
    """The breakdown of one step of `role` on one GPU (µs by part)."""
    b = Breakdown()
    ep = role.ep_size if s.is_moe else 1
    slots = s.experts + (role.redundant if ep > 1 else 0)  # replicas need several ranks
    tbo = role.tbo and ep > 1 and x.tokens >= 2
    halves = [x.tokens - x.tokens // 2, x.tokens // 2] if tbo else [x.tokens]
    spec = CommSpec(ep, role.gpus_per_node, s.hidden, max(s.topk, 1), s.groups, s.topk_groups)
    backend = role.backend(x.kind)
    slow = 1.0
    if tbo and backend == "deepep_normal":
        sms = c.profile.sms.value
        slow = sms / (sms - COMM_SMS)
    per = []  # per micro-batch: (pre, mid, post, dispatch, combine) of one MoE layer
    for t in halves:
        core, gemm, other = _attention(s, c, x, dtype, t)
        if s.is_moe:
            experts, shared, router = _moe_compute(s, c, x, dtype, t, ep, slots)
            disp, comb = dispatch_combine(backend, spec, t, x.balance, c.profile)
        else:
            experts = shared = router = disp = comb = Cost(0.0, "measured")
        per.append((core, gemm, other, experts, shared, router, disp, comb))
        for part, cost in (("attention", core), ("gemm", gemm), ("other", other),
                           ("moe", experts), ("gemm", shared), ("other", router),
                           ("dispatch", disp), ("combine", comb)):
            b.add(part, cost, s.moe_layers)
        if s.dense_layers:
            b.add("attention", core, s.dense_layers)
            b.add("gemm", gemm + _dense_mlp(s, c, dtype, t), s.dense_layers)
            b.add("other", other, s.dense_layers)
    if tbo:
        pre = [(p[0] + p[1] + p[2] + p[5]).us * slow for p in per]
        mid = [p[3].us * slow for p in per]
        post = [p[4].us * slow for p in per]
        disp, comb = [p[6].us for p in per], [p[7].us for p in per]
        state = (0.0, 0.0, 0.0)
        for _ in range(s.moe_layers):
            state = tbo_layer(pre, mid, post, disp, comb, state)
        serial = sum(pre) + sum(mid) + sum(post) + sum(disp) + sum(comb)
        b.parts["tbo_hidden"] = state[0] - serial * s.moe_layers
        b.sources["tbo_hidden"] = Counter(model=1)
    head = c.gemm(round(x.logits), s.hidden, s.vocab, "bf16") if x.logits else Cost(0, "measured")
    b.add("gemm", head)
    # final norm; embedding gather and greedy argmax
    b.add("other", c.norm(x.tokens, s.hidden) + c.glue(max(round(x.logits), 1), s.hidden).times(2))
    graphs = role.graphs if role.graphs is not None else (x.kind == "decode" and ep == 1)
    if not graphs and c.kernels == "moeserve":
        host = EAGER_HOST_US_PER_LAYER * s.layers * (2 if tbo else 1)
        b.parts["host"] = max(0.0, host - b.total_us)
        b.sources["host"] = Counter(measured=1)
    return b
