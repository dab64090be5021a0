"""A recording stand-in for the CUDA stream operations of ep/streams.py (StreamOps), so that the
side-stream path of the dispatchers runs, and is checked, on CPU."""

from __future__ import annotations

import contextlib

import torch


class RecordingOps:
    """StreamOps that log what the CUDA implementation would do and check its invariants: work
    enters the side stream only after it waited for the compute stream (launch) or continues it
    (finish); the compute stream waits only for events that were recorded; tensors handed over are
    marked for the compute stream while their event is waited."""

    def __init__(self):
        self.log: list[tuple] = []
        self.on_side = False
        self.recorded: set[int] = set()
        self.waited: set[int] = set()
        self.handed: list[torch.Tensor] = []

    def comm_wait_compute(self) -> None:
        assert not self.on_side
        self.log.append(("side waits compute",))

    @contextlib.contextmanager
    def on_comm(self):
        assert not self.on_side, "side stream entered twice"
        self.on_side = True
        self.log.append(("enter side",))
        try:
            yield
        finally:
            self.on_side = False
            self.log.append(("leave side",))

    def record_comm(self) -> int:
        assert not self.on_side
        event = len(self.recorded)
        self.recorded.add(event)
        self.log.append(("record", event))
        return event

    def compute_wait(self, event: int) -> None:
        assert event in self.recorded and not self.on_side
        self.waited.add(event)
        self.log.append(("compute waits", event))

    def used_by_compute(self, t: torch.Tensor) -> None:
        assert self.log[-1][0] in ("compute waits", "handed over")
        self.handed.append(t)
        self.log.append(("handed over",))
