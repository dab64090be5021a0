"""bench.one_batch's prefill timing: the prefill is timed --prefill-reps times over the same KV
slots, its tok/s is the median's, and the peak line states the slowest and fastest of them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from moeserve.bench.one_batch import bench_moeserve, prefill_peak_line
from moeserve.bench.prefill_flops import prefill_flops


@pytest.fixture
def runner(tiny_model):
    from moeserve.config import compose
    from moeserve.runtime.model_runner import ModelRunner

    path = tiny_model("qwen3")
    return ModelRunner(compose([f"model.path='{path}'", "device=cpu", "model.dtype=float32",
                                "cuda_graph.enabled=false"]), path)


def test_median_of_the_timed_prefills_and_their_spread(runner, monkeypatch):
    import moeserve.bench.one_batch as ob

    clock = iter([0.0, 3.0, 10.0, 11.0, 20.0, 22.0] + [30.0 + i for i in range(20)])
    monkeypatch.setattr(ob, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    run = bench_moeserve(runner, 1, 12, 3, prefill_reps=3)
    assert run.prefill_tps == 12 / 2.0  # prefills of 3, 1 and 2 s: the median's tok/s
    assert run.prefill_spread == (12 / 3.0, 12 / 1.0)
    single = bench_moeserve(runner, 1, 12, 3)
    assert single.prefill_spread is None and single.prefill_tps > 0


def test_peak_line_states_the_share_of_the_median_and_the_spread(runner):
    per_token = prefill_flops(runner, 2, 12) / 24
    peak = per_token * 1000.0  # 1000 tok/s would be 100% of it
    line = prefill_peak_line(runner, 2, 12, 500.0, peak, (400.0, 650.0))
    assert "= 50.0% of the measured matmul peak" in line
    assert line.endswith("; the timed prefills 40.0-65.0%")
    assert "timed prefills" not in prefill_peak_line(runner, 2, 12, 500.0, peak)
