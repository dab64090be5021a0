"""Where each expert lives: the placement tensors the MoE layer reads every forward.

Physical slot p lives on rank p // (P / ep_size); node n is ranks [n * R, (n + 1) * R) with
R = ep_size / num_nodes. The router emits logical ids; `to_physical` turns them into the slot this
rank sends each token to, with one device gather and no host sync. A rebalance builds a new
ExpertLocation and `update_`s the live one in place, so tensors captured by CUDA graphs (or held by
other modules) keep pointing at the current placement.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from moeserve.eplb.algorithm import rebalance_experts

PLACEMENT_FORMAT = "moeserve.eplb.placement"
PLACEMENT_VERSION = 1
_TABLES = (
    "physical_to_logical",
    "logical_to_all_physical",
    "logical_count",
    "logical_to_rank_dispatch_physical",
)


def logical_to_all_physical(phy2log: torch.Tensor, num_logical: int, width: int) -> torch.Tensor:
    """Replica lists in slot order: phy2log [L, P] -> [L, E, width], -1 padded."""
    num_layers, num_phy = phy2log.shape
    values, slots = phy2log.sort(dim=-1, stable=True)  # [L, P] slots grouped by logical id
    ones = torch.ones_like(phy2log)
    counts = torch.zeros(num_layers, num_logical, dtype=torch.int64).scatter_add_(-1, phy2log, ones)
    starts = counts.cumsum(-1) - counts  # [L, E] first sorted position of each logical id
    replica = torch.arange(num_phy) - starts.gather(-1, values)  # [L, P] replica index of each slot
    out = torch.full((num_layers, num_logical * width), -1, dtype=torch.int64)
    out.scatter_(-1, values * width + replica, slots)
    return out.view(num_layers, num_logical, width)


def _nth_true(mask: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """Index of the n-th (0-based) True along the last dim: mask [..., X], n [...] -> [...]."""
    hit = mask & (mask.long().cumsum(-1) - 1 == n.unsqueeze(-1))
    return hit.long().argmax(-1)


def dispatch_table(
    log2phy: torch.Tensor, num_physical: int, ep_size: int, num_nodes: int, ep_rank: int
) -> torch.Tensor:
    """The replica `ep_rank` sends each logical expert's tokens to: [L, E, X] -> [L, E].

    Nearest first: a replica on this rank, else one on this node, else any. When several on the
    node (or, failing that, anywhere) qualify, the rank id picks one (rank % count), so ranks
    without a local copy spread their tokens over the replicas instead of all hitting the first.
    """
    valid = log2phy >= 0  # [L, E, X]
    owner = torch.where(valid, log2phy, 0) // (num_physical // ep_size)  # [L, E, X] rank of replica
    ranks_per_node = ep_size // num_nodes
    same_rank = valid & (owner == ep_rank)
    same_node = valid & (owner // ranks_per_node == ep_rank // ranks_per_node)
    n_node = same_node.sum(-1)  # [L, E]
    pick = _nth_true(valid, ep_rank % valid.sum(-1).clamp(min=1))  # [L, E] index into X
    pick = torch.where(n_node > 0, _nth_true(same_node, ep_rank % n_node.clamp(min=1)), pick)
    pick = torch.where(same_rank.any(-1), same_rank.long().argmax(-1), pick)
    return log2phy.gather(-1, pick.unsqueeze(-1)).squeeze(-1)


@dataclass
class ExpertLocation:
    """L layers x E logical experts on P physical slots over ep_size ranks, as seen by `ep_rank`."""

    physical_to_logical: torch.Tensor  # [L, P]
    logical_to_all_physical: torch.Tensor  # [L, E, X], X = P - E + 1, -1 padded
    logical_count: torch.Tensor  # [L, E] replicas per logical expert
    logical_to_rank_dispatch_physical: torch.Tensor  # [L, E] the replica this rank sends to
    ep_size: int
    num_nodes: int = 1
    ep_rank: int = 0
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def num_layers(self) -> int:
        return self.physical_to_logical.shape[0]

    @property
    def num_physical(self) -> int:
        return self.physical_to_logical.shape[1]

    @property
    def num_logical(self) -> int:
        return self.logical_count.shape[1]

    @property
    def slots_per_rank(self) -> int:
        return self.num_physical // self.ep_size

    def local_slots(self, rank: int | None = None) -> range:
        """Physical slots held by `rank` (default: this rank)."""
        r = self.ep_rank if rank is None else rank
        return range(r * self.slots_per_rank, (r + 1) * self.slots_per_rank)

    # ---- constructors ----
    @classmethod
    def from_physical_to_logical(
        cls,
        phy2log: torch.Tensor,
        num_logical: int,
        ep_size: int,
        num_nodes: int = 1,
        ep_rank: int = 0,
        log2phy: torch.Tensor | None = None,
        device: torch.device | str = "cpu",
        metadata: dict[str, Any] | None = None,
    ) -> ExpertLocation:
        """Derive every table from phy2log [L, P]; pass log2phy [L, E, X'] to keep its order."""
        phy2log = phy2log.long().cpu()
        num_phy = phy2log.shape[1]
        _check_layout(num_logical, num_phy, ep_size, num_nodes, ep_rank)
        width = num_phy - num_logical + 1  # most replicas one expert can have
        if log2phy is None:
            log2phy = logical_to_all_physical(phy2log, num_logical, width)
        else:
            log2phy = F.pad(log2phy.long().cpu(), (0, width - log2phy.shape[-1]), value=-1)
        count = (log2phy >= 0).sum(-1)  # [L, E]
        if int(count.min()) < 1:
            raise ValueError("every logical expert needs at least one physical replica")
        table = dispatch_table(log2phy, num_phy, ep_size, num_nodes, ep_rank)
        tensors = [t.to(device) for t in (phy2log, log2phy, count, table)]
        return cls(*tensors, ep_size, num_nodes, ep_rank, dict(metadata or {}))

    @classmethod
    def trivial(
        cls,
        num_layers: int,
        num_logical: int,
        ep_size: int,
        num_redundant: int = 0,
        num_nodes: int = 1,
        ep_rank: int = 0,
        device: torch.device | str = "cpu",
    ) -> ExpertLocation:
        """Slot p holds expert p % E: checkpoint order, redundant slots cycling from expert 0."""
        phy2log = torch.arange(num_logical + num_redundant) % num_logical  # [P]
        phy2log = phy2log.expand(num_layers, -1).contiguous()  # [L, P]
        meta = {"source": "trivial"}
        return cls.from_physical_to_logical(
            phy2log, num_logical, ep_size, num_nodes, ep_rank, device=device, metadata=meta
        )

    @classmethod
    def from_algorithm(
        cls,
        load: torch.Tensor,
        ep_size: int,
        num_nodes: int = 1,
        num_redundant: int = 0,
        num_groups: int = 1,
        ep_rank: int = 0,
        device: torch.device | str = "cpu",
        metadata: dict[str, Any] | None = None,
    ) -> ExpertLocation:
        """Run DeepSeek's EPLB on a logical load [L, E] (token counts per layer and expert)."""
        num_logical = load.shape[1]
        num_phy = num_logical + num_redundant
        placement = rebalance_experts(load, num_phy, num_groups, num_nodes, ep_size)
        meta = {"source": "eplb", "num_groups": num_groups, **(metadata or {})}
        return cls.from_physical_to_logical(
            placement.phy2log, num_logical, ep_size, num_nodes, ep_rank,
            log2phy=placement.log2phy, device=device, metadata=meta,
        )  # fmt: skip

    def for_rank(self, ep_rank: int) -> ExpertLocation:
        """The same placement as another rank sees (and dispatches) it."""
        return ExpertLocation.from_physical_to_logical(
            self.physical_to_logical, self.num_logical, self.ep_size, self.num_nodes, ep_rank,
            log2phy=self.logical_to_all_physical, device=self.physical_to_logical.device,
            metadata=self.metadata,
        )  # fmt: skip

    # ---- hot path ----
    def to_physical(self, topk_ids: torch.Tensor, layer: int) -> torch.Tensor:
        """Router output (logical ids) -> the slot each token goes to, on the device, no sync.

        topk_ids: [T, K] any int dtype (negative = masked, passed through) -> [T, K] same dtype.
        """
        table = self.logical_to_rank_dispatch_physical[layer]  # [E]
        flat = topk_ids.reshape(-1)  # [T*K]
        phys = table.index_select(0, flat.clamp(min=0).long()).to(topk_ids.dtype)
        return torch.where(flat < 0, flat, phys).view_as(topk_ids)

    def update_(self, other: ExpertLocation) -> None:
        """Take `other`'s placement by copying into this object's tensors (same shapes/layout)."""
        if (other.ep_size, other.num_nodes) != (self.ep_size, self.num_nodes):
            raise ValueError("update_ needs the same ep_size and num_nodes")
        src = other if other.ep_rank == self.ep_rank else other.for_rank(self.ep_rank)
        for name in _TABLES:  # NOTE: all shapes checked first, so a failed update changes nothing
            mine, theirs = getattr(self, name).shape, getattr(src, name).shape
            if mine != theirs:
                raise ValueError(f"{name}: shape {tuple(theirs)} != {tuple(mine)}")
        for name in _TABLES:
            getattr(self, name).copy_(getattr(src, name))
        self.metadata = dict(other.metadata)

    # ---- files ----
    def save(self, path: str, metadata: dict[str, Any] | None = None) -> None:
        """Write placement.json: the maps plus the layout they are valid for."""
        doc = {
            "format": PLACEMENT_FORMAT,
            "version": PLACEMENT_VERSION,
            "num_layers": self.num_layers,
            "num_logical_experts": self.num_logical,
            "num_physical_experts": self.num_physical,
            "ep_size": self.ep_size,
            "num_nodes": self.num_nodes,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "metadata": {**self.metadata, **(metadata or {})},
            "physical_to_logical": self.physical_to_logical.tolist(),
            "logical_to_all_physical": self.logical_to_all_physical.tolist(),
        }
        with open(path, "w") as f:
            json.dump(doc, f)

    @classmethod
    def load(
        cls, path: str, ep_rank: int = 0, device: torch.device | str = "cpu"
    ) -> ExpertLocation:
        """Read placement.json (written by `save`) as seen from `ep_rank`."""
        with open(path) as f:
            doc = json.load(f)
        if doc.get("format") != PLACEMENT_FORMAT:
            raise ValueError(f"{path} is not a moeserve placement file")
        log2phy = doc.get("logical_to_all_physical")
        return cls.from_physical_to_logical(
            torch.tensor(doc["physical_to_logical"]), doc["num_logical_experts"], doc["ep_size"],
            doc["num_nodes"], ep_rank, log2phy=None if log2phy is None else torch.tensor(log2phy),
            device=device, metadata=doc.get("metadata", {}),
        )  # fmt: skip


def _check_layout(num_logical: int, num_phy: int, ep_size: int, nodes: int, ep_rank: int) -> None:
    if num_phy < num_logical:
        raise ValueError(f"{num_phy} physical slots < {num_logical} logical experts")
    if num_phy % ep_size or ep_size % nodes:
        raise ValueError(f"{num_phy} slots / ep_size {ep_size} / {nodes} nodes do not divide")
    if not 0 <= ep_rank < ep_size:
        raise ValueError(f"ep_rank {ep_rank} not in [0, {ep_size})")
