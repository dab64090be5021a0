"""The traffic a deployment serves: lengths, prefix hits, and how popular each expert is; and
the balancedness that popularity leaves after our own EPLB algorithm placed the experts.

Balancedness (mean / max tokens per GPU in a MoE layer, SGLang's measure) sets how long the
busiest GPU's experts and transfers take. It comes from running `moeserve.eplb` on the
popularity: EPLB places the experts (E + redundant slots over the EP ranks, hierarchically when
groups divide by nodes) from a large sample of the distribution, then one step's tokens are drawn
again and the per-GPU loads of that step are measured. Small steps add sampling noise on top of
the skew, which is why decode at a few tokens per GPU balances worse than prefill.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from moeserve.eplb import balancedness, rank_load, rebalance_experts, trivial_rank_load

FIT_TOKENS = 4096  # tokens of the sample EPLB places from (per layer)
SIM_LAYERS = 8  # layers simulated (each its own popularity order)


@dataclass(frozen=True)
class Workload:
    input_len: int = 2000
    output_len: int = 100
    prefix_hit: float = 0.0  # share of the prompt already in the prefix cache
    popularity: str = "zipf:0.8"  # zipf:S (i-th expert ∝ 1/i^S, shuffled per layer) | DUMP path
    seed: int = 0

    @property
    def new_prefill_tokens(self) -> float:
        return self.input_len * (1 - self.prefix_hit)


def zipf_draw(layers: int, experts: int, topk: int, tokens: int, s: float, seed: int
              ) -> torch.Tensor:
    """[L, E] pair counts of `tokens` tokens each picking `topk` distinct experts, the i-th most
    popular with weight 1 / i^s, the order shuffled per layer: `eplb simulate`'s routing
    (eplb.cli.zipf_load), drawn by Gumbel top-k, which samples without replacement in
    proportion to the weights as torch.multinomial does, in one vectorised op."""
    gen = torch.Generator().manual_seed(seed)
    popularity = torch.arange(1, experts + 1, dtype=torch.float32) ** -s  # [E] by rank
    load = torch.zeros(layers, experts, dtype=torch.int64)
    for layer in range(layers):
        logp = popularity[torch.randperm(experts, generator=gen)].log()  # [E]
        u = torch.rand(tokens, experts, generator=gen)
        picks = (logp - (-u.log()).log()).topk(topk, dim=-1).indices  # [T, K] distinct
        load[layer] = torch.bincount(picks.flatten(), minlength=experts)
    return load


@lru_cache(maxsize=32)
def inclusion_rates(popularity: str, layers: int, experts: int, topk: int, seed: int
                    ) -> torch.Tensor:
    """[L, E] share of (token, expert) pairs each expert gets: from a Zipf draw (`zipf_draw`)
    or from a recorded dump's logical loads."""
    if popularity.startswith("zipf:"):
        load = zipf_draw(layers, experts, topk, FIT_TOKENS, float(popularity[5:]), seed)
    else:
        from moeserve.eplb import load_dump

        load = load_dump(popularity).logical_load()
        if load.shape[1] != experts:
            raise ValueError(f"{popularity}: {load.shape[1]} experts, the model has {experts}")
        load = load[:layers] if load.shape[0] >= layers else load
    load = load.double() + 1e-9
    return load / load.sum(-1, keepdim=True)


@lru_cache(maxsize=512)
def step_balancedness(popularity: str, experts: int, topk: int, groups: int, ep: int,
                      redundant: int, nodes: int, tokens_per_gpu: int, eplb: bool = True,
                      seed: int = 0) -> float:
    """Balancedness of one step with `tokens_per_gpu` tokens on each of `ep` GPUs: time-weighted
    over the simulated layers (sum of means / sum of maxima), the loads drawn for that step.

    eplb=False: the trivial placement (expert e on GPU e // (E / ep)), no redundant slots.
    """
    if ep <= 1:
        return 1.0
    rates = inclusion_rates(popularity, SIM_LAYERS, experts, topk, seed)  # [L, E]
    rng = np.random.default_rng(seed + 1)
    pairs = max(int(tokens_per_gpu * ep * topk), 1)
    step = torch.from_numpy(np.stack([rng.multinomial(pairs, r / r.sum())
                                      for r in rates.numpy()])).double()  # [L, E]
    if not eplb:
        if experts % ep:
            raise ValueError(f"{experts} experts do not divide over ep {ep} without EPLB slots")
        return _time_weighted(trivial_rank_load(step, ep))
    fit = rates * FIT_TOKENS * topk
    return max(_time_weighted(_eplb_load(fit, step, experts, r, groups, nodes, ep))
               for r in feasible_redundancy(experts, redundant, ep))


def feasible_redundancy(experts: int, redundant: int, ep: int) -> list[int]:
    """Redundancies r <= `redundant` whose E + r slots divide over ep. A deployment with more
    slots can always hold a smaller one's placement (a spare slot holds a second copy of an expert
    already on that GPU, which changes no GPU's load), so the planner keeps the best of them:
    more redundant experts never lower its balancedness."""
    out = [r for r in range(redundant + 1) if (experts + r) % ep == 0]
    if not out:
        raise ValueError(f"no redundancy <= {redundant} makes {experts} + r experts divide over "
                         f"ep {ep}")
    return out


def _eplb_load(fit: torch.Tensor, load: torch.Tensor, experts: int, redundant: int, groups: int,
               nodes: int, ep: int) -> torch.Tensor:
    groups = groups if groups % max(nodes, 1) == 0 else 1
    p = rebalance_experts(fit, experts + redundant, groups, nodes, ep)
    return rank_load(p.phy2log, load, p.logcnt, ep)


def _time_weighted(loads: torch.Tensor) -> float:
    """Sum over layers of the mean GPU load over the sum of the busiest GPU's: the share of the
    step's MoE time that is useful when every layer waits for its busiest GPU."""
    return float(loads.mean(-1).sum() / loads.amax(-1).sum())


def expected_balancedness(popularity: str, experts: int, topk: int, groups: int, ep: int,
                          redundant: int, nodes: int, seed: int = 0) -> float:
    """Balancedness on the distribution itself (an infinite batch): what EPLB's placement
    reaches before sampling noise, per layer as in `eplb.balancedness`, averaged."""
    rates = inclusion_rates(popularity, SIM_LAYERS, experts, topk, seed)
    return max(float(balancedness(_eplb_load(rates, rates, experts, r, groups, nodes, ep)).mean())
               for r in feasible_redundancy(experts, redundant, ep))


def raw_eplb_balancedness(popularity: str, experts: int, topk: int, groups: int, ep: int,
                          redundant: int, nodes: int, seed: int = 0) -> float:
    """What EPLB's placement with exactly `redundant` slots reaches on the distribution (no
    keeping of a smaller redundancy's placement)."""
    rates = inclusion_rates(popularity, SIM_LAYERS, experts, topk, seed)
    return float(balancedness(_eplb_load(rates, rates, experts, redundant, groups, nodes,
                                         ep)).mean())
