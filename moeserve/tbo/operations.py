"""The op-list vocabulary of two-batch overlap (TBO) and the executor that interleaves two lists.

A model forward is an ordered list of `Op`s (each reads and writes one `ForwardState`) with `YIELD`
markers between them. `run_straight` runs the list as one batch (the plain forward: yields are
ignored); `run_interleaved` runs two micro-batches' states over the same list, stage by stage:

    A: stage 0 | B: stage 0 | A: stage 1 | B: stage 1 | ...

A stage ends at a YIELD, and a MoE layer yields right after it starts a dispatch or a combine, so
the other micro-batch's compute runs while that communication is in flight (see DecoderLayer's op
list in models/llama.py).

Why stage-by-stage with no offset: with the yields after dispatch_start and combine_start, every
communication of one micro-batch is already bracketed by a compute stage of the other, so the
simplest schedule overlaps all of them; SGLang's per-mode stage offsets are not needed here.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from moeserve.forward_batch import ForwardBatch


@dataclass
class MoEStepState:
    """What one MoE layer's ops hand each other, for one micro-batch (reset every layer)."""

    x: torch.Tensor | None = None  # [T, H] normed input of the router / experts / shared experts
    topk_weights: torch.Tensor | None = None  # [T, K] float32
    topk_ids: torch.Tensor | None = None  # [T, K] physical slots
    dispatch: Any = None  # DispatchHandle in flight
    dispatched: Any = None  # DispatchOutput once waited
    expert_out: torch.Tensor | None = None  # local experts' output (dispatched layout)
    combine: Any = None  # CombineHandle in flight
    routed: torch.Tensor | None = None  # [T, H] sum over all routed experts
    shared: torch.Tensor | None = None  # [T, H] shared experts' output (None: none)


@dataclass
class ForwardState:
    """One (micro-)batch going through the op list: explicit state, no globals."""

    fb: ForwardBatch
    positions: torch.Tensor  # [T]
    hidden: torch.Tensor | None = None  # [T, H] the running stream between layers
    residual: torch.Tensor | None = None  # [T, H] (None before the first layer)
    attn: tuple = ()  # attention intermediates between prepare / core / output
    moe: MoEStepState = field(default_factory=MoEStepState)
    name: str = ""  # "a" / "b" for micro-batches (timeline labels)


@dataclass(frozen=True)
class Op:
    """One step of a forward; `layer` labels it in the timeline (-1: model-level)."""

    name: str
    fn: Callable[[ForwardState], None]
    layer: int = -1


@dataclass(frozen=True)
class Yield:
    """Stage boundary: the executor switches to the other micro-batch here."""


YIELD = Yield()
OpList = Sequence[Op | Yield]


def run_straight(ops: OpList, state: ForwardState) -> None:
    """The plain forward: every op in order, yields ignored."""
    for op in ops:
        if isinstance(op, Op):
            op.fn(state)


def stages(ops: OpList) -> list[list[Op]]:
    """The op list cut at its yields (consecutive yields make no empty stage)."""
    out: list[list[Op]] = [[]]
    for op in ops:
        if isinstance(op, Yield):
            if out[-1]:
                out.append([])
        else:
            out[-1].append(op)
    return [s for s in out if s]


def run_interleaved(ops: OpList, a: ForwardState, b: ForwardState,
                    timeline: Timeline | None = None) -> None:
    """Both micro-batches through `ops`, alternating at every yield (A first)."""
    for stage in stages(ops):
        for state in (a, b):
            for op in stage:
                if timeline is None:
                    op.fn(state)
                else:
                    timeline.run(op, state)


@dataclass
class Timeline:
    """Start/end of every op per micro-batch (MOESERVE_TBO_TIMELINE): shows which micro-batch
    computes while the other's dispatch or combine is in flight (between its *_start and its
    *_wait). Times are seconds since the timeline was made; one list per forward step."""

    rank: int = 0
    path: str | None = None  # JSON lines rewritten after each recorded step (None: memory only)
    max_steps: int = 16  # record the first steps only: a debug view, not a log
    t0: float = field(default_factory=time.perf_counter)
    events: list[dict] = field(default_factory=list)
    step: int = 0

    @property
    def recording(self) -> bool:
        return self.step < self.max_steps

    def run(self, op: Op, state: ForwardState) -> None:
        start = time.perf_counter()
        op.fn(state)
        self.events.append({"step": self.step, "mb": state.name, "op": op.name,
                            "layer": op.layer, "start": start - self.t0,
                            "end": time.perf_counter() - self.t0})

    def end_step(self) -> None:
        self.step += 1
        if self.path is not None:
            self.dump(self.path)

    def comm_spans(self) -> list[dict]:
        """Communication in flight: from each *_start's end to its *_wait's start, per
        micro-batch and layer."""
        open_: dict[tuple, float] = {}
        spans = []
        for e in self.events:
            kind, _, phase = e["op"].rpartition("_")
            key = (e["step"], e["mb"], e["layer"], kind)
            if phase == "start":
                open_[key] = e["end"]
            elif phase == "wait" and key in open_:
                spans.append({"step": e["step"], "mb": e["mb"], "layer": e["layer"],
                              "kind": kind, "start": open_.pop(key), "end": e["start"]})
        return spans

    def overlap_fraction(self) -> float:
        """Share of in-flight communication time during which the other micro-batch ran an op."""
        total = covered = 0.0
        for s in self.comm_spans():
            total += s["end"] - s["start"]
            for e in self.events:
                if e["step"] == s["step"] and e["mb"] != s["mb"]:
                    covered += max(0.0, min(e["end"], s["end"]) - max(e["start"], s["start"]))
        return covered / total if total > 0 else 0.0

    def dump(self, path: str) -> None:
        """JSON lines: every op event, then the communication spans (kind field set)."""
        with open(path, "w") as f:
            for e in self.events:
                f.write(json.dumps({"rank": self.rank, **e}) + "\n")
            for s in self.comm_spans():
                f.write(json.dumps({"rank": self.rank, "in_flight": True, **s}) + "\n")

    def render(self, step: int = 0, layer: int | None = None) -> str:
        """A text view of one step: one line per op, `a`/`b` columns, times in ms."""
        rows = [e for e in self.events if e["step"] == step and (layer is None or
                                                                 e["layer"] == layer)]
        lines = [f"{'start ms':>9} {'end ms':>9}  {'a':<18} {'b':<18} layer"]
        for e in rows:
            col = f"{e['op']:<18} {'':<18}" if e["mb"] == "a" else f"{'':<18} {e['op']:<18}"
            lines.append(f"{e['start'] * 1e3:9.3f} {e['end'] * 1e3:9.3f}  {col} {e['layer']}")
        return "\n".join(lines)
