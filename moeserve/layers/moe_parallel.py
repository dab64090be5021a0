"""Where a model's routed experts live: physical expert slots (logical experts plus redundant
replicas) spread evenly over the EP ranks, the EPLB placement that maps router ids to slots, the
dispatcher that moves tokens between ranks, and the recorder that counts each layer's routing.
`MoEParallel.make_experts` builds each MoE layer's local experts (in FP8 where the checkpoint's
experts stay FP8).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from moeserve.layers.fp8_moe import Fp8MoEExperts
from moeserve.layers.moe import MoEExperts


class ExpertRecorder(Protocol):
    """Receives each MoE layer's routing every forward, as physical slot ids (= logical ids
    without redundant experts); the EPLB recorder counts them on the device."""

    def record(self, layer_id: int, topk_ids: torch.Tensor) -> None: ...


class NullRecorder:
    def record(self, layer_id: int, topk_ids: torch.Tensor) -> None:
        pass


@dataclass
class MoEParallel:
    """How routed experts are spread: physical slot p (logical experts + redundant replicas) lives
    on rank p // (P / ep_size); `location` (an eplb ExpertLocation, None = identity) maps router
    ids to slots; tokens move through `dispatcher` (None: all slots local, no communication)."""

    ep_rank: int = 0
    ep_size: int = 1
    dispatcher: Any = None  # moeserve.ep.dispatcher.Dispatcher
    recorder: ExpertRecorder = field(default_factory=NullRecorder)
    location: Any = None  # moeserve.eplb.location.ExpertLocation
    experts_by_layer: dict[int, MoEExperts] = field(default_factory=dict)  # for live rebalance
    moe_backend: str = "torch"  # torch | triton (the runner resolves moe.backend=auto)
    moe_config_dir: str | None = None  # tuned fused-MoE launch configs (moe.config_dir)
    # (rows, cols) of FP8 weight blocks: experts built resident in FP8 (layers/fp8_moe.py); None:
    # in the model dtype (models/quantization.py decides)
    fp8_block: tuple[int, int] | None = None

    def num_physical(self, num_logical: int) -> int:
        return num_logical if self.location is None else self.location.num_physical

    def make_experts(self, num_logical: int, hidden: int, intermediate: int,
                     layer_id: int) -> MoEExperts:
        num_phy = self.num_physical(num_logical)
        if num_phy % self.ep_size:
            raise ValueError(f"{num_phy} physical experts do not divide over ep_size "
                             f"{self.ep_size} (eplb.num_redundant_experts)")
        n = num_phy // self.ep_size
        first = self.ep_rank * n
        slots = None
        if self.location is not None:
            slots = self.location.physical_to_logical[layer_id, first : first + n].tolist()
        kwargs = dict(first_expert=first, num_local=n, slot_logical=slots,
                      backend=self.moe_backend, config_dir=self.moe_config_dir)
        if self.fp8_block is not None:
            experts = Fp8MoEExperts(num_phy, hidden, intermediate, block=self.fp8_block, **kwargs)
        else:
            experts = MoEExperts(num_phy, hidden, intermediate, **kwargs)
        self.experts_by_layer[layer_id] = experts
        return experts
