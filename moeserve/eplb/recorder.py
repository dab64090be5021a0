"""Expert-load recording: how many tokens each physical expert of each layer received.

Counts stay on the device and grow with `scatter_add_` (no `.item()`, no `bincount` size probe),
so recording costs no host sync per step. The ring position is a device tensor as well, so a
captured graph that records keeps writing into the open pass. Only `dump` copies to the host.

Modes:
  stat      one [L, P] accumulator since `start()` (or the last `reset()`).
  per_pass  a ring of the last `window` closed passes plus the open one, [W+1, L, P]; `step()`
            closes a pass. Old passes fall out, so a dump reflects recent traffic (what a
            periodic rebalance wants).

The MoE layer calls `record(layer_id, topk_ids)` with the ids it dispatches on. When it hands
over router (logical) ids, pass `location=` and `input_space="logical"`: they are mapped with this
rank's dispatch table, which is exactly where those tokens go.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist

from moeserve.eplb.location import ExpertLocation

DUMP_FORMAT = "moeserve.eplb.dump"


def fold_to_logical(counts: torch.Tensor, phy2log: torch.Tensor, num_logical: int) -> torch.Tensor:
    """Sum each physical slot's count into its logical expert: [L, P] x [L, P] -> [L, E] int64."""
    out = torch.zeros(counts.shape[0], num_logical, dtype=torch.int64, device=counts.device)
    return out.scatter_add_(-1, phy2log.to(counts.device).long(), counts.long())


class ExpertDistributionRecorder:
    """Implements `moeserve.layers.moe_parallel.ExpertRecorder`; one per rank."""

    def __init__(
        self,
        num_layers: int,
        num_physical: int,
        mode: Literal["stat", "per_pass"] = "stat",
        window: int = 128,
        location: ExpertLocation | None = None,
        input_space: Literal["physical", "logical"] = "physical",
        device: torch.device | str = "cpu",
    ) -> None:
        if mode not in ("stat", "per_pass"):
            raise ValueError(f"unknown mode {mode!r}")
        if input_space == "logical" and location is None:
            raise ValueError("logical input ids need a location to map them to physical slots")
        self.num_layers, self.num_physical = num_layers, num_physical
        self.mode, self.window = mode, window
        self.location, self.input_space = location, input_space
        slots = window + 1 if mode == "per_pass" else 1
        # NOTE: one extra column per layer swallows masked ids (< 0) without a data-dependent branch
        shape = (slots, num_layers, num_physical + 1)
        self._buf = torch.zeros(shape, dtype=torch.int64, device=device)  # [W+1 or 1, L, P+1]
        self._slot = torch.zeros(1, dtype=torch.int64, device=device)  # ring index of the open pass
        self.recording = False
        # CUDA graphs: a captured record() must count while recording and add 0 otherwise, and
        # skip the bucket's padded rows, with no Python running at replay. `_on` (0/1) and
        # `capture_rows` (a [T] 0/1 row mask, set by the graph runner during capture) do that.
        self._on = torch.zeros(1, dtype=torch.int64, device=device)
        self.capture_rows: torch.Tensor | None = None
        # CUDA: count with one Triton launch (kernels/triton/expert_count.py) instead of ~10
        # torch ops; None: the torch ops (CPU). The model runner sets it, True meaning a PDL launch.
        self.kernel_pdl: bool | None = None
        self.steps = 0
        self.topk = 0
        self.start_time: float | None = None
        self.end_time: float | None = None

    # ---- control ----
    def start(self) -> None:
        self.recording = True
        self._on.fill_(1)
        self.start_time = self.start_time or time.time()
        self.end_time = None

    def stop(self) -> None:
        self.recording = False
        self._on.fill_(0)
        self.end_time = time.time()

    def reset(self) -> None:
        self._buf.zero_()
        self._slot.zero_()
        self.steps = 0
        self.start_time = time.time() if self.recording else None
        self.end_time = None

    # ---- hot path ----
    def record(self, layer_id: int, topk_ids: torch.Tensor) -> None:
        """Add one layer's routing of one forward: topk_ids [T, K] (ids < 0 are ignored)."""
        capturing = self.capture_rows is not None
        if not self.recording and not capturing:
            return
        if self.input_space == "logical":
            topk_ids = self.location.to_physical(topk_ids, layer_id)
        k = self.topk = topk_ids.shape[-1] if topk_ids.dim() > 1 else 1
        if self.kernel_pdl is not None:
            from moeserve.kernels.triton.expert_count import count_routed

            count_routed(topk_ids, self._buf, self._slot, self._on, layer_id, self.num_layers,
                         self.capture_rows, pdl=self.kernel_pdl)
            return
        ids = topk_ids.reshape(-1).long()  # [T*K]
        ids = torch.where(ids < 0, self.num_physical, ids)
        row = self._slot * self.num_layers + layer_id  # [1] (open pass, layer) row of the buffer
        flat = self._buf.view(-1)  # [(W+1) * L * (P+1)]
        if capturing:  # [T] row mask repeated per choice, times the on/off switch
            add = (self.capture_rows[:, None] * self._on).expand(-1, k).reshape(-1)
        else:
            add = torch.ones_like(ids)
        flat.scatter_add_(0, ids + row * (self.num_physical + 1), add)

    def step(self) -> None:
        """Close one forward pass (the scheduler calls this after each forward)."""
        if not self.recording:
            return
        self.steps += 1
        if self.mode == "per_pass":
            self._slot.add_(1).remainder_(self._buf.shape[0])
            self._buf.index_fill_(0, self._slot, 0)

    # ---- results ----
    def physical_counts(self) -> torch.Tensor:
        """Tokens routed to each physical slot over the recorded span: [L, P] int64, on device."""
        return self._buf[..., : self.num_physical].sum(0)

    def logical_load(self, location: ExpertLocation | None = None) -> torch.Tensor:
        """Fold physical counts back to logical experts with `location`'s phy2log: [L, E] int64."""
        loc = location or self.location
        if loc is None:
            raise ValueError("logical_load needs an ExpertLocation")
        return fold_to_logical(self.physical_counts(), loc.physical_to_logical, loc.num_logical)

    def dump(
        self, path: str, metadata: dict[str, Any] | None = None, group: Any = None
    ) -> ExpertDump:
        """Write counts + metadata to `path` (torch.save) and return them.

        With a process `group`, every rank must call this: counts are summed over the group
        (each rank only sees its own tokens) and rank 0 of the group writes the file.
        """
        counts = self.physical_counts()
        if group is not None:
            dist.all_reduce(counts, group=group)
        loc = self.location
        meta: dict[str, Any] = {
            "num_layers": self.num_layers,
            "num_physical_experts": self.num_physical,
            "num_logical_experts": loc.num_logical if loc else self.num_physical,
            "ep_size": loc.ep_size if loc else 1,
            "num_nodes": loc.num_nodes if loc else 1,
            "mode": self.mode,
            "window": self.window if self.mode == "per_pass" else None,
            "steps": self.steps,
            "topk": self.topk,
            "start_time": self.start_time,
            "end_time": self.end_time or time.time(),
            **(metadata or {}),
        }
        if loc is not None:
            phy2log = loc.physical_to_logical.cpu()
        else:
            phy2log = torch.arange(self.num_physical).expand(self.num_layers, -1).contiguous()
        out = ExpertDump(counts.cpu(), phy2log, meta)
        if group is None or dist.get_rank(group) == 0:
            out.save(path)
        return out


@dataclass
class ExpertDump:
    """A recorded load: physical counts [L, P], the phy2log [L, P] they were recorded under,
    metadata (model, layers, experts, ep size, nodes, steps, start/end time, topk, ...)."""

    physical_counts: torch.Tensor  # [L, P] int64
    physical_to_logical: torch.Tensor  # [L, P] int64
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def num_logical(self) -> int:
        default = int(self.physical_to_logical.max()) + 1
        return int(self.metadata.get("num_logical_experts") or default)

    @property
    def ep_size(self) -> int:
        return int(self.metadata.get("ep_size") or 1)

    @property
    def num_nodes(self) -> int:
        return int(self.metadata.get("num_nodes") or 1)

    def logical_load(self) -> torch.Tensor:
        """[L, E] int64 tokens per logical expert."""
        return fold_to_logical(self.physical_counts, self.physical_to_logical, self.num_logical)

    def location(self, ep_rank: int = 0) -> ExpertLocation:
        """The placement the dump was recorded under."""
        return ExpertLocation.from_physical_to_logical(
            self.physical_to_logical, self.num_logical, self.ep_size, self.num_nodes, ep_rank
        )

    def save(self, path: str) -> None:
        doc = {
            "format": DUMP_FORMAT,
            "version": 1,
            "physical_counts": self.physical_counts,
            "physical_to_logical": self.physical_to_logical,
            "metadata": self.metadata,
        }
        torch.save(doc, path)


def load_dump(path: str) -> ExpertDump:
    """Read a file written by `ExpertDistributionRecorder.dump` (weights_only: plain data only)."""
    doc = torch.load(path, map_location="cpu", weights_only=True)
    if doc.get("format") != DUMP_FORMAT:
        raise ValueError(f"{path} is not a moeserve expert-distribution dump")
    return ExpertDump(doc["physical_counts"], doc["physical_to_logical"], dict(doc["metadata"]))


def load_init_placement(
    path: str,
    ep_size: int,
    num_nodes: int = 1,
    num_redundant: int = 0,
    num_groups: int = 1,
    ep_rank: int = 0,
    device: torch.device | str = "cpu",
) -> ExpertLocation:
    """`eplb.init_placement`: a placement.json as written, or a recorder dump run through EPLB
    for this layout (so a dump from one deployment can seed another of a different size)."""
    if path.endswith(".json"):
        loc = ExpertLocation.load(path, ep_rank=ep_rank, device=device)
        if (loc.ep_size, loc.num_nodes, loc.num_physical - loc.num_logical) != (
            ep_size, num_nodes, num_redundant,
        ):  # fmt: skip
            raise ValueError(f"{path} was made for another layout (ep, nodes, redundant)")
        return loc
    dump = load_dump(path)
    meta = {"model": dump.metadata.get("model"), "from_dump": path}
    return ExpertLocation.from_algorithm(
        dump.logical_load(), ep_size, num_nodes, num_redundant, num_groups, ep_rank, device, meta
    )


def merge_rank_dumps(replies: list[dict[str, Any]], metadata: dict[str, Any]) -> ExpertDump:
    """Sum the per-rank counts that each scheduler rank reports (`expert_record_dump` control op)
    into one dump: each rank only sees the tokens it routed, all with the same placement."""
    if not replies:
        raise ValueError("no rank replied")
    counts = sum(torch.tensor(r["counts"], dtype=torch.int64) for r in replies)  # [L, P]
    first = replies[0]
    layers, num_phy = counts.shape
    phy2log = (torch.tensor(first["phy2log"], dtype=torch.int64) if first["phy2log"] is not None
               else torch.arange(num_phy).expand(layers, -1).contiguous())
    meta = {"num_layers": layers, "num_physical_experts": num_phy,
            "num_logical_experts": first["num_logical"], "ep_size": first["ep_size"],
            "num_nodes": first["num_nodes"], "mode": "stat", "steps": max(r["steps"] for r in replies),
            "topk": first["topk"], "start_time": first["start_time"], "end_time": time.time(),
            **metadata}
    return ExpertDump(counts, phy2log, meta)
