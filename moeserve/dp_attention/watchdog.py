"""Lockstep watchdog: says, in one log line, where every DP rank stood when the lockstep stalls.

Two stalls, both seen as "no rank runs a step" from outside:
- a rank waits in the per-step DP sync longer than `timeout_s` (a peer is gone, hung, or reached a
  different collective);
- a rank has work (waiting or running requests) yet schedules nothing for `timeout_s` while the
  sync keeps turning (a local admission livelock: its peers idle, it spins).
A daemon thread checks every quarter of the timeout and logs each stall once per timeout, with
every rank's last known state from the latest sync (step, mode, tokens, waiting, running, pending
lockstep ops). `on_stall` lets a caller (elastic EP) treat the first kind as a failure signal.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from moeserve.env import env

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankState:
    """One rank's row of the DP sync, as the watchdog prints it."""

    rank: int
    step: int  # DP syncs this rank has entered
    mode: str
    tokens: int
    waiting: int
    running: int
    ops: int

    def describe(self) -> str:
        return (f"r{self.rank} step {self.step} {self.mode} tok {self.tokens} "
                f"wait {self.waiting} run {self.running} ops {self.ops}")


class LockstepWatchdog:
    def __init__(self, rank: int, timeout_s: float,
                 on_stall: Callable[[str, float], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, start_thread: bool = True):
        self.rank, self.timeout_s, self.on_stall, self.clock = rank, timeout_s, on_stall, clock
        self.last_states: list[RankState] = []  # from the latest completed sync
        self._mine: RankState | None = None  # what this rank brought to the sync it is in
        self._sync_since: float | None = None
        self._idle_with_work_since: float | None = None
        self._reported: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = None
        if timeout_s > 0 and start_thread:
            self._thread = threading.Thread(target=self._watch, name="lockstep-watchdog",
                                            daemon=True)
            self._thread.start()

    # ---- called by the scheduler loop ---------------------------------------------------------
    def entering_sync(self, mine: RankState) -> None:
        self._mine = mine
        self._sync_since = self.clock()

    def left_sync(self, states: list[RankState], has_work: bool, scheduled: bool) -> None:
        """After the sync: the ranks' rows, and whether this rank had work and a batch."""
        now = self.clock()
        self.last_states, self._sync_since = states, None
        if has_work and not scheduled:
            self._idle_with_work_since = self._idle_with_work_since or now
        else:
            self._idle_with_work_since = None

    def close(self) -> None:
        self._stop.set()

    # ---- checks (the thread; also callable directly) -------------------------------------------
    def check(self) -> list[str]:
        """Log and return a line for each stall older than the timeout (once per timeout each)."""
        now, lines = self.clock(), []
        since = self._sync_since
        if since is not None and now - since > self.timeout_s:
            lines.append(self._report("sync", now - since,
                                      f"waiting {now - since:.1f} s in the DP sync"))
        since = self._idle_with_work_since
        if since is not None and now - since > self.timeout_s:
            lines.append(self._report("idle", now - since,
                                      f"has work but scheduled nothing for {now - since:.1f} s"))
        return [line for line in lines if line]

    def _report(self, kind: str, waited: float, what: str) -> str:
        now = self.clock()
        if now - self._reported.get(kind, -1e18) < self.timeout_s:
            return ""
        self._reported[kind] = now
        mine = self._mine.describe() if self._mine is not None else "?"
        others = " | ".join(s.describe() for s in self.last_states) or "no sync completed yet"
        line = (f"lockstep stall: rank {self.rank} {what}; brought [{mine}]; "
                f"last known: {others}")
        logger.error(line)
        if self.on_stall is not None and kind == "sync":
            self.on_stall(line, waited)
        return line

    def _watch(self) -> None:
        while not self._stop.wait(self.timeout_s / 4):
            self.check()


class SyncJitter:
    """MOESERVE_TEST_SYNC_JITTER (env.py): a random pause before each DP sync, seeded per rank."""

    def __init__(self, max_ms: float, seed: int, rank: int):
        self.max_s, self.rng = max_ms / 1000, random.Random(seed * 1009 + rank)

    @classmethod
    def from_env(cls, rank: int) -> SyncJitter | None:
        spec = env().test_sync_jitter
        return None if spec is None else cls(spec[0], spec[1], rank)

    def sleep(self) -> None:
        time.sleep(self.rng.random() * self.max_s)
