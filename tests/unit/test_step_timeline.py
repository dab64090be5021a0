"""MOESERVE_STEP_TIMELINE: one JSON line per loop iteration with its laps, notes and the loop
thread's CPU time and run-queue wait from /proc."""

from __future__ import annotations

import json
import time

from moeserve.scheduler.timeline import NullTimeline, StepTimeline


def test_lines_say_where_an_iteration_went(tmp_path):
    tl = StepTimeline.from_env(3, str(tmp_path / "steps"))
    for i in range(2):
        tl.begin()
        time.sleep(0.02)
        tl.lap("recv")
        tl.note("in_tokens", 5)
        tl.note("in_tokens", 7)
        end = time.perf_counter() + 0.03
        while time.perf_counter() < end:  # on the CPU
            pass
        tl.lap("fwd")
        tl.end("DECODE", 4)
    tl.close()
    (path,) = tmp_path.glob("steps.rank3.*.jsonl")
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert len(lines) == 2
    x = lines[1]
    assert x["mode"] == "DECODE" and x["bs"] == 4 and x["notes"] == {"in_tokens": 12}
    assert x["laps"]["recv"] >= 0.02 and x["laps"]["fwd"] >= 0.03
    assert abs(x["dur"] - sum(x["laps"].values())) < 0.005
    assert 0.02 <= (x["run_ms"] + x["wait_ms"]) / 1e3  # the spin ran or waited for its core
    assert x["run_ms"] / 1e3 < x["dur"] + 0.005  # the sleep was not CPU time


def test_off_unless_set():
    assert isinstance(StepTimeline.from_env(0, None), NullTimeline)
