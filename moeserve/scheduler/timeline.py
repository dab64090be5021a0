"""StepTimeline (MOESERVE_STEP_TIMELINE=PREFIX): one JSON line per scheduler loop iteration, in
PREFIX.rank{r}.{pid}.jsonl, saying where the iteration's wall time went.

Each line: `t` (wall clock at the iteration's start, to line up with other processes), `dur`,
`laps` (seconds per phase: `pd_poll`, `recv`, `handle`, `sched`, `fwd`, `proc`), `notes` (what
else the loop did: requests taken in and their prompt tokens, KV slots reserved and activated
for PD), the step's `mode` and batch size, and the loop thread's own CPU time and run-queue wait
(`run_ms`, `wait_ms`, from /proc's schedstat: time the thread was runnable but another thread had
its core). A decode ITL spike is then either a long phase (work in the loop) or a long wait
(another process on the core). A debug view: off unless the variable is set.
"""

from __future__ import annotations

import json
import os
import threading
import time


class StepTimeline:
    def __init__(self, path: str):
        self._file = open(path, "w", buffering=1 << 16)
        self._stat = f"/proc/self/task/{threading.get_native_id()}/schedstat"
        self._laps: dict[str, float] = {}
        self._notes: dict[str, float] = {}
        self._wall = self._start = self._last = 0.0
        self._sched = (0, 0)
        self._flushed = time.monotonic()

    @classmethod
    def from_env(cls, rank: int, prefix: str | None) -> StepTimeline | NullTimeline:
        if not prefix:
            return NullTimeline()
        return cls(f"{prefix}.rank{rank}.{os.getpid()}.jsonl")

    def begin(self) -> None:
        self._wall, self._start = time.time(), time.perf_counter()
        self._last = self._start
        self._laps, self._notes = {}, {}
        self._sched = self._schedstat()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self._laps[name] = self._laps.get(name, 0.0) + now - self._last
        self._last = now

    def note(self, key: str, value: float = 1) -> None:
        self._notes[key] = self._notes.get(key, 0) + value

    def end(self, mode: str | None, batch_size: int) -> None:
        run, wait = (b - a for a, b in zip(self._sched, self._schedstat()))
        line = {"t": round(self._wall, 6), "dur": time.perf_counter() - self._start,
                "laps": self._laps, "notes": self._notes, "mode": mode, "bs": batch_size,
                "run_ms": run / 1e6, "wait_ms": wait / 1e6}
        self._file.write(json.dumps(line) + "\n")
        if time.monotonic() - self._flushed > 1.0:
            self._file.flush()
            self._flushed = time.monotonic()

    def close(self) -> None:
        self._file.close()

    def _schedstat(self) -> tuple[int, int]:
        try:
            with open(self._stat) as f:
                run, wait, _ = f.read().split()
            return int(run), int(wait)
        except (OSError, ValueError):  # not Linux, or no schedstats
            return 0, 0


class NullTimeline:
    """The timeline when it is off: every hook does nothing."""

    def begin(self) -> None:
        pass

    def lap(self, name: str) -> None:
        pass

    def note(self, key: str, value: float = 1) -> None:
        pass

    def end(self, mode: str | None, batch_size: int) -> None:
        pass

    def close(self) -> None:
        pass
