"""bench/pd_trace.py's sampler: a spinning thread shows up with its CPU time and its core."""

from __future__ import annotations

import json
import os
import threading

from moeserve.bench.pd_trace import sample


def test_sampler_sees_a_busy_thread(tmp_path):
    stop, tid = threading.Event(), {}

    def spin():
        tid["id"] = threading.get_native_id()
        while not stop.is_set():
            pass

    t = threading.Thread(target=spin)
    t.start()
    try:
        out = str(tmp_path / "cpu.jsonl")
        sample(out, 0.3, 0.05)
    finally:
        stop.set()
        t.join()
    with open(out) as f:
        rows = [r for line in f for r in json.loads(line)["threads"] if r[1] == tid["id"]]
    assert rows and all(r[0] == os.getpid() for r in rows)
    assert sum(r[4] for r in rows) / 1e9 > 0.05  # run ns: it was on a core
    assert {r[3] for r in rows} <= os.sched_getaffinity(0)
