"""Timing primitives of the kernel-cost bench: a CUDA graph of back-to-back calls over weight copies
larger than L2 (a decode step's weights are cold), eager fallbacks, and the copy count."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable

import torch

COLD_BYTES = 256 << 20  # weights cycled per graph: several times an H100/H200 L2 (50-60 MB)
TARGET_S = 4e-3  # device time of one timed graph replay


def time_graph(make_call: Callable[[int], Callable[[], object]], copies: int,
               device: torch.device) -> float:
    """Microseconds per call: `reps` calls captured in one CUDA graph, call i on copy i %
    copies, replayed; median of 3 replays. `make_call(i)` returns the i-th call. On CPU (or
    where capture fails) eager calls timed with perf_counter."""
    calls = [make_call(i) for i in range(copies)]
    for c in calls:
        c()  # compile / probe outside any capture
    if device.type != "cuda":
        return _time_eager_cpu(calls)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    calls[0]()
    torch.cuda.synchronize()
    one = max(time.perf_counter() - t0, 1e-6)
    reps = int(min(max(TARGET_S / one, 2 * copies), 200))
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for r in range(reps):
                calls[r % copies]()
    except RuntimeError:
        torch.cuda.synchronize()
        return _time_eager_cuda(calls, reps)
    return _replay_us(graph.replay, reps)


def _replay_us(fn: Callable[[], object], reps: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    out = []
    for _ in range(3):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        out.append(start.elapsed_time(end) * 1e3 / reps)
    return statistics.median(out)


def _time_eager_cuda(calls: list[Callable[[], object]], reps: int) -> float:
    def run() -> None:
        for r in range(reps):
            calls[r % len(calls)]()
    return _replay_us(run, reps)


def _time_eager_cpu(calls: list[Callable[[], object]]) -> float:
    out = []
    for _ in range(3):
        t0 = time.perf_counter()
        for c in calls:
            c()
        out.append((time.perf_counter() - t0) / len(calls) * 1e6)
    return statistics.median(out)


def copies_for(nbytes: int) -> int:
    """Weight copies so that one pass over them exceeds L2 several times (at most 8)."""
    return int(min(8, max(1, math.ceil(COLD_BYTES / max(nbytes, 1)))))
