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


def test_floor_ratio_counts_dense_weights_twice_and_each_halfs_experts(tiny_model):
    """Split, the dense weights are read twice and the experts once per micro-batch that routed
    to them: the ratio lies between the dense-only and the all-doubled extremes, and it equals
    the bytes recomputed from each half's recorded experts."""
    import torch

    from moeserve.bench.roofline import step_bytes, touched_experts
    from moeserve.bench.tbo_overhead import Steps, floor_ratio
    from moeserve.config import compose
    from moeserve.runtime.model_runner import ModelRunner
    from moeserve.tbo.split import split_batch

    path = tiny_model("qwen3_moe")
    runner = ModelRunner(compose([f"model.path='{path}'", "device=cpu", "model.dtype=float32",
                                  "cuda_graph.enabled=false"]), path)
    with torch.inference_mode():
        st = Steps(runner, 8, 6)
        st.prefill_kv(64)
        make = st.decode()
        ratio = floor_ratio(runner, make, 7)
        whole = touched_experts(runner, make(False))
        halves = [touched_experts(runner, p) for p in split_batch(make(True))]
    assert whole is not None and whole.any()
    assert torch.equal(halves[0] | halves[1], whole)  # the same tokens route the same way
    off = step_bytes(runner, 8, 7, whole)
    assert 1.0 < ratio < 2.0
    doubled = (2 * off.weights + 2 * off.experts + off.kv + off.io) / off.total
    assert ratio <= doubled + 1e-9
    on = sum(step_bytes(runner, 4, 7, t).total for t in halves)
    assert abs(ratio - on / off.total) < 1e-12
