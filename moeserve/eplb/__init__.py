"""Expert-parallel load balancing (DESIGN §7): DeepSeek's EPLB algorithm, placement metadata and
expert-load recording."""

from __future__ import annotations

from moeserve.eplb.algorithm import (
    Placement,
    balanced_packing,
    balancedness,
    rank_load,
    rebalance_experts,
    rebalance_experts_hierarchical,
    replicate_experts,
    trivial_rank_load,
)

__all__ = [
    "Placement",
    "balanced_packing",
    "balancedness",
    "rank_load",
    "rebalance_experts",
    "rebalance_experts_hierarchical",
    "replicate_experts",
    "trivial_rank_load",
]
