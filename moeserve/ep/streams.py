"""Where a dispatcher's communication runs while the other TBO micro-batch computes.

CUDA: each dispatcher owns one side stream (`CommStream`). An overlapped *_start (a micro-batch of
a two-batch-overlap step) enters it after everything the compute stream has queued so far (the
inputs are ready), launches its copies / collectives / barriers there and records a done event;
the matching *_wait makes the compute stream wait for that event (the host never blocks) and
marks the tensors made on the side stream as used by the compute stream, so the caching allocator
does not hand their memory out before the compute stream is done with them. Inputs made on the
compute stream stay referenced by the handle until that join. NCCL collectives launched from the
side stream run on NCCL's own stream after it, and their `Work.wait()` inside the side stream
orders the side stream after them.

Plain steps (not overlapped) run everything on the compute stream as before: CUDA-graph capture
and the non-TBO paths are unchanged.

CPU: no streams. gloo collectives started with async_op=True run on gloo's worker threads while
the host computes the other micro-batch, and `Work.wait()` blocks the host; every method here is a
no-op. The stream operations sit behind `StreamOps` so that tests can check the ordering of the
CUDA path on a CPU-only machine (tests/ep/test_comm_stream.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Protocol

import torch


class StreamOps(Protocol):
    """The stream operations `CommStream` needs (CUDA: `CudaStreamOps`)."""

    def comm_wait_compute(self) -> None: ...  # side stream waits for the compute stream's queue
    def on_comm(self) -> contextlib.AbstractContextManager: ...  # side stream is current in here
    def record_comm(self) -> Any: ...  # an event at the side stream's current end
    def compute_wait(self, event: Any) -> None: ...  # compute stream waits for the event
    def used_by_compute(self, t: torch.Tensor) -> None: ...  # t (made on the side) read there


class CudaStreamOps:
    """StreamOps on one CUDA device: a dedicated side stream, events, record_stream."""

    def __init__(self, device: torch.device):
        self.device = device
        self.comm = torch.cuda.Stream(device=device)

    def _compute(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def comm_wait_compute(self) -> None:
        self.comm.wait_stream(self._compute())

    def on_comm(self) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(self.comm)

    def record_comm(self) -> Any:
        return self.comm.record_event()

    def compute_wait(self, event: Any) -> None:
        self._compute().wait_event(event)

    def used_by_compute(self, t: torch.Tensor) -> None:
        t.record_stream(self._compute())


class CommStream:
    """A dispatcher's side stream (see the module docstring). `on` arguments say whether this call
    overlaps (an overlapped micro-batch on a device with streams); everything is a no-op when not.
    """

    def __init__(self, device: torch.device, ops: StreamOps | None = None):
        if ops is None and device.type == "cuda":
            ops = CudaStreamOps(device)
        self.ops = ops

    def use(self, overlapped: bool) -> bool:
        """Whether a call with this `overlapped` flag runs on the side stream."""
        return overlapped and self.ops is not None

    @contextlib.contextmanager
    def launch(self, on: bool) -> Iterator[None]:
        """The body runs on the side stream, after the work the compute stream queued so far."""
        if not on:
            yield
            return
        self.ops.comm_wait_compute()
        with self.ops.on_comm():
            yield

    @contextlib.contextmanager
    def finish(self, on: bool) -> Iterator[None]:
        """The body runs on the side stream, after its earlier work only (the receive side of a
        launch: it must not wait for the other micro-batch's compute queued since)."""
        if not on:
            yield
            return
        with self.ops.on_comm():
            yield

    def done(self, on: bool) -> Any:
        """An event after the side stream's work so far (None when not on)."""
        return self.ops.record_comm() if on else None

    def join(self, event: Any, outputs: tuple = ()) -> None:
        """The compute stream waits for `event`; `outputs` (tensors or None) made on the side stream
        are marked as read by the compute stream. No-op for event None (not overlapped)."""
        if event is None:
            return
        self.ops.compute_wait(event)
        for t in outputs:
            if isinstance(t, torch.Tensor):
                self.ops.used_by_compute(t)
