"""Dispatch and combine times of one MoE layer on one GPU: DeepEP's two modes, inside a node
(NVLink) and across nodes (RDMA), fitted to DeepEP's published tables, and our `p2p` backend
fitted to `bench.ep` on 2xH200.

What crosses the wire. Normal mode (prefill) sends each token once to every remote node holding
one of its experts (then forwards inside the node over NVLink); low-latency mode (decode) sends
each (token, expert) pair on its own. Dispatch carries FP8 activations (hidden bytes plus one
float32 scale per 128 channels), combine carries bf16. The rank that receives the most sets the
time, so both are divided by the step's balancedness.

Published tables (DeepEP V1, docs/legacy.md; H800, ConnectX-7 400 Gb/s, ~50 GB/s per GPU):
normal mode at 4096 tokens, bottleneck RDMA bandwidth EP16/32/64: dispatch 43/58/51 GB/s,
combine 43/57/50; intranode EP8 over NVLink (~160 GB/s usable on the H800): 153 / 158 GB/s.
Low-latency at 128 tokens, EP 8..256: dispatch 77/118/155/173/192/194 us (98/63/48/43/39/39
GB/s), combine 114/195/273/314/369/360 us (127/74/53/46/39/40 GB/s). RDMA bandwidths scale
with the profile's NIC over those 50 GB/s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moeserve.planner.costs import Cost, interp
from moeserve.planner.profiles import HardwareProfile

NORMAL_EP = [16.0, 32.0, 64.0]
NORMAL_DISPATCH_GBPS = [43.0, 58.0, 51.0]
NORMAL_COMBINE_GBPS = [43.0, 57.0, 50.0]
# DeepEP normal mode inside a node: 292 GB/s best combine on 2xH200 (docs/planner.md, Reference
# measurements) of NVLink's 450 one way; DeepEP's H800 table, 153 of ~200 GB/s, is about the
# same share
NVL_FRACTION = 292.0 / 450.0
LL_EP = [8.0, 16.0, 32.0, 64.0, 128.0, 256.0]
LL_DISPATCH_GBPS = [98.0, 63.0, 48.0, 43.0, 39.0, 39.0]
LL_COMBINE_GBPS = [127.0, 74.0, 53.0, 46.0, 39.0, 40.0]
LL_DISPATCH_US = [77.0, 118.0, 155.0, 173.0, 192.0, 194.0]
LL_TOKENS = 128
REF_NIC_GBPS = 50.0
# our p2p backend, 2xH200 bench.ep (docs/planner.md, Reference measurements): 60.1% of NVLink's
# one direction at 4096 tokens/rank; 0.306 ms dispatch + combine at 128 tokens/rank, nearly all
# of it fixed cost
P2P_NVL_FRACTION, P2P_FIXED_US = 0.601, 290.0
# DeepEP low-latency inside one node, 2xH200 (docs/planner.md, Reference measurements): 28.6 us
# dispatch + 39.3 us combine
LL_NVL_DISPATCH_US, LL_NVL_COMBINE_US = 28.6, 39.3


@dataclass(frozen=True)
class CommSpec:
    ep: int
    gpus_per_node: int
    hidden: int
    topk: int
    groups: int = 1  # DeepSeek's group-limited routing: a token touches at most topk_groups
    topk_groups: int = 1

    @property
    def nodes(self) -> int:
        return max(1, math.ceil(self.ep / self.gpus_per_node))

    def fp8_token_bytes(self) -> float:
        return self.hidden + 4 * math.ceil(self.hidden / 128)

    def bf16_token_bytes(self) -> float:
        return 2.0 * self.hidden

    def remote_nodes_per_token(self) -> float:
        """Distinct other nodes a token's top-k experts live on (random placement; groups packed
        to nodes by EPLB's hierarchical policy when groups divide by nodes)."""
        n = self.nodes
        if n == 1:
            return 0.0
        if self.groups > 1 and self.groups % n == 0:
            g, pick, per = self.groups, self.topk_groups, self.groups // n
            miss = math.comb(g - per, pick) / math.comb(g, pick)  # a node owns none of them
        else:
            miss = (1 - 1 / n) ** self.topk
        return (1 - miss) * n * (n - 1) / n

    def remote_pair_fraction(self) -> float:
        """Share of (token, expert) pairs whose expert lives on another GPU."""
        return 1 - 1 / self.ep


def _bw(table: list[float], ep: float) -> float:
    return interp(NORMAL_EP if len(table) == 3 else LL_EP, table, ep)[0] if ep <= (
        NORMAL_EP[-1] if len(table) == 3 else LL_EP[-1]) else table[-1]


def _remote_gpus(spec: CommSpec) -> float:
    """Distinct other GPUs of the node a token's top-k experts live on (random placement)."""
    return (spec.ep - 1) * (1 - (1 - 1 / spec.ep) ** spec.topk)


def normal(spec: CommSpec, tokens: float, balance: float, prof: HardwareProfile
           ) -> tuple[Cost, Cost]:
    """DeepEP normal mode (prefill): (dispatch, combine) of `tokens` tokens on the busiest GPU."""
    if spec.ep <= 1 or tokens <= 0:
        return Cost(0.0, "measured"), Cost(0.0, "measured")
    balance = max(balance, 1e-3)
    if spec.nodes == 1:
        bw = NVL_FRACTION * prof.nvlink_gbps.value * 1e9
        sent = tokens * _remote_gpus(spec)
        d = sent * spec.fp8_token_bytes() / bw / balance
        c = sent * spec.bf16_token_bytes() / bw / balance
        return Cost(d * 1e6, "measured"), Cost(c * 1e6, "measured")
    scale = prof.nic_gbps.value / REF_NIC_GBPS
    sent = tokens * spec.remote_nodes_per_token()
    d = sent * spec.fp8_token_bytes() / (_bw(NORMAL_DISPATCH_GBPS, spec.ep) * 1e9 * scale)
    c = sent * spec.bf16_token_bytes() / (_bw(NORMAL_COMBINE_GBPS, spec.ep) * 1e9 * scale)
    return Cost(d / balance * 1e6, "published"), Cost(c / balance * 1e6, "published")


def low_latency(spec: CommSpec, tokens: float, balance: float, prof: HardwareProfile
                ) -> tuple[Cost, Cost]:
    """DeepEP low-latency mode (decode): (dispatch, combine) for `tokens` tokens per GPU. It
    sends every pair, so time grows with the pairs; below the tables' 128 tokens it keeps at
    least half of their time (a latency floor)."""
    if spec.ep <= 1 or tokens <= 0:
        return Cost(0.0, "measured"), Cost(0.0, "measured")
    f = max(tokens / LL_TOKENS, 0.5) / max(balance, 1e-3)
    if spec.nodes == 1:  # NVLink: DeepEP's own test on 2xH200, scaled by pairs
        return (Cost(LL_NVL_DISPATCH_US * f, "measured"),
                Cost(LL_NVL_COMBINE_US * f, "measured"))
    scale = prof.nic_gbps.value / REF_NIC_GBPS
    pairs = LL_TOKENS * spec.topk  # the table's, times f below
    d = pairs * spec.fp8_token_bytes() / (_bw(LL_DISPATCH_GBPS, spec.ep) * 1e9 * scale)
    c = pairs * spec.bf16_token_bytes() / (_bw(LL_COMBINE_GBPS, spec.ep) * 1e9 * scale)
    return Cost(d * f * 1e6, "published"), Cost(c * f * 1e6, "published")


def p2p(spec: CommSpec, tokens: float, balance: float, prof: HardwareProfile
        ) -> tuple[Cost, Cost]:
    """Our p2p backend inside one node: the larger of its fixed cost and the bytes at the
    NVLink share bench.ep measured (2xH200; docs/planner.md, Reference measurements), half
    each way."""
    if spec.ep <= 1 or tokens <= 0:
        return Cost(0.0, "measured"), Cost(0.0, "measured")
    bw = P2P_NVL_FRACTION * prof.nvlink_gbps.value * 1e9
    one_way = tokens * _remote_gpus(spec) * spec.bf16_token_bytes() / bw / max(balance, 1e-3)
    us = max(P2P_FIXED_US / 2, one_way * 1e6)
    return Cost(us, "interpolated"), Cost(us, "interpolated")


BACKENDS = {"deepep_normal": normal, "deepep_ll": low_latency, "p2p": p2p}


def dispatch_combine(backend: str, spec: CommSpec, tokens: float, balance: float,
                     prof: HardwareProfile) -> tuple[Cost, Cost]:
    if backend not in BACKENDS:
        raise ValueError(f"unknown EP backend {backend!r}; known: {sorted(BACKENDS)}")
    return BACKENDS[backend](spec, tokens, balance, prof)
