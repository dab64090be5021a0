"""Expert-parallel load balancing (docs/architecture.md §7): DeepSeek's EPLB algorithm, placement
metadata and expert-load recording."""

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
from moeserve.eplb.location import ExpertLocation
from moeserve.eplb.recorder import (
    ExpertDistributionRecorder,
    ExpertDump,
    load_dump,
    load_init_placement,
)

__all__ = [
    "ExpertDistributionRecorder",
    "ExpertDump",
    "ExpertLocation",
    "Placement",
    "balanced_packing",
    "balancedness",
    "load_dump",
    "load_init_placement",
    "rank_load",
    "rebalance_experts",
    "rebalance_experts_hierarchical",
    "replicate_experts",
    "trivial_rank_load",
]
