"""pytest plugin: `DURLOG=FILE python -m pytest -p durations_log ...` appends each test phase's
duration to FILE as it finishes (time, worker, seconds, phase, outcome, node id), so a run that
is cut short still leaves its timings, and the per-file and per-directory sums can be read off
at any point (docs/testing.md). Under xdist the controller writes every worker's reports."""

from __future__ import annotations

import os
import time


def pytest_runtest_logreport(report) -> None:
    path = os.environ.get("DURLOG")
    if not path:
        return
    node = getattr(report, "node", None)  # xdist's controller: the worker that ran it
    worker = getattr(getattr(node, "gateway", None), "id", "-")
    with open(path, "a") as f:
        f.write(f"{time.time():.1f} {worker} {report.duration:.2f} {report.when} "
                f"{report.outcome} {report.nodeid}\n")
