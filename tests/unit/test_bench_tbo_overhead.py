"""bench.tbo_overhead's trace reading: the side stream's busy time beside the main stream's kernels
(synthetic chrome trace, the fields torch's profiler writes)."""

from __future__ import annotations

import json

from moeserve.bench.tbo_overhead import trace_overlap


def _event(cat: str, stream: int, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": cat, "name": "k", "ts": ts, "dur": dur, "tid": stream,
            "args": {"stream": stream}}


def test_trace_overlap_counts_side_time_beside_main_kernels(tmp_path):
    events = [_event("kernel", 7, 0, 100), _event("kernel", 7, 150, 100),  # main: busiest
              _event("gpu_memcpy", 20, 50, 100),  # 50 of 100 us beside main kernels
              _event("cuda_runtime", 1, 0, 1000)]  # host-side: ignored
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    line = trace_overlap(str(path))
    assert "stream 7: 2 ops 200 us" in line and "stream 20: 1 ops 100 us" in line
    assert line.endswith("50% of 100 us")


def test_trace_overlap_one_stream(tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": [_event("kernel", 7, 0, 10)]}))
    assert trace_overlap(str(path)).startswith("1 CUDA stream(s)")
