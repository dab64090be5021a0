"""bench.eplb_skew on CPU (its GPU form is `scripts/gpu_check.sh eplb_skew`): dp2 x ep2 under the
Zipf router hook, no EPLB vs EPLB placements from the recorded dump, with redundant experts."""

from __future__ import annotations

import os

import pytest

from moeserve.bench.eplb_skew import ZIPF_ENV, main
from moeserve.eplb.recorder import load_dump


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_eplb_skew_table(tiny_model, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(ZIPF_ENV, raising=False)
    rows = main(["--model", tiny_model("deepseek_v3"), "--name", "tiny-v3", "--ranks", "2",
                 "--redundant", "4", "--batch", "8", "--input", "24", "--output", "4",
                 "--repeats", "1", "--dump-dir", str(tmp_path), "-o", "scheduler.overlap=false"])
    assert ZIPF_ENV not in os.environ  # restored
    assert list(rows) == ["none", "eplb", "eplb+4"]
    assert [r["physical"] for r in rows.values()] == [16, 16, 20]
    assert all(0 < r["balancedness"] <= 1 and r["decode_tps"] > 0 for r in rows.values())
    # the same workload in every row (same prompts, greedy), so EPLB's placement for exactly
    # this load cannot be worse than the default one, and a redundant replica of the hottest
    # experts beats it
    assert rows["eplb"]["balancedness"] >= rows["none"]["balancedness"]
    assert rows["eplb+4"]["balancedness"] > rows["none"]["balancedness"]
    loads = [load_dump(r["dump"]).logical_load() for r in rows.values()]
    assert all((load == loads[0]).all() for load in loads)
    out = capsys.readouterr().out
    assert "tiny-v3, router skew Zipf(1.2), dp2×ep2 (p2p, gloo, CPU)" in out
    assert "eplb+4" in out and "balancedness" in out
