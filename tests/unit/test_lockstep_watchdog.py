"""The lockstep watchdog: a rank stuck in the DP sync, or holding work while it schedules nothing,
is reported once per timeout with every rank's last known state; progress reports nothing."""

from __future__ import annotations

import logging

from moeserve.dp_attention.watchdog import LockstepWatchdog, RankState


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def states(step: int) -> list[RankState]:
    return [RankState(0, step, "DECODE", 17, 3, 17, 0), RankState(1, step, "none", 0, 0, 0, 1)]


def test_a_stall_in_the_sync_names_every_rank_once_per_timeout(caplog):
    clock, stalls = Clock(), []
    dog = LockstepWatchdog(1, 10.0, on_stall=lambda line, s: stalls.append(s), clock=clock,
                           start_thread=False)
    dog.left_sync(states(41), has_work=False, scheduled=False)
    dog.entering_sync(RankState(1, 42, "none", 0, 0, 0, 0))
    clock.t += 9.0
    assert dog.check() == []
    clock.t += 2.0
    with caplog.at_level(logging.ERROR):
        (line,) = dog.check()
    assert "rank 1 waiting 11.0 s in the DP sync" in line
    assert "brought [r1 step 42 none tok 0 wait 0 run 0 ops 0]" in line
    assert "r0 step 41 DECODE tok 17 wait 3 run 17 ops 0 | r1 step 41 none" in line
    assert line in caplog.text and stalls == [11.0]
    clock.t += 5.0
    assert dog.check() == []  # once per timeout
    clock.t += 6.0
    assert len(dog.check()) == 1 and len(stalls) == 2
    dog.left_sync(states(42), has_work=False, scheduled=False)
    clock.t += 60.0
    assert dog.check() == []  # the sync completed: no stall


def test_work_without_a_batch_is_a_stall_and_progress_clears_it():
    clock = Clock()
    dog = LockstepWatchdog(0, 10.0, clock=clock, start_thread=False)
    for _ in range(5):  # the sync turns, but this rank has work and never schedules
        dog.entering_sync(RankState(0, 1, "none", 0, 48, 0, 0))
        dog.left_sync(states(1), has_work=True, scheduled=False)
        clock.t += 3.0
    (line,) = dog.check()
    assert "rank 0 has work but scheduled nothing for 15.0 s" in line
    assert "brought [r0 step 1 none tok 0 wait 48 run 0 ops 0]" in line
    dog.left_sync(states(2), has_work=True, scheduled=True)
    clock.t += 30.0
    assert dog.check() == []
    dog.left_sync(states(3), has_work=False, scheduled=False)  # idle without work is fine
    clock.t += 30.0
    assert dog.check() == []


def test_the_thread_reports_a_real_stall(caplog):
    with caplog.at_level(logging.ERROR):
        dog = LockstepWatchdog(0, 0.2)
        dog.entering_sync(RankState(0, 7, "EXTEND", 5, 0, 1, 0))
        import time

        deadline = time.monotonic() + 5
        while "lockstep stall" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
        dog.close()
    assert "rank 0 waiting" in caplog.text and "r0 step 7 EXTEND" in caplog.text


def test_zero_timeout_starts_no_thread():
    dog = LockstepWatchdog(0, 0.0)
    assert dog._thread is None
