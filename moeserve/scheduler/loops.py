"""The scheduler's two loops, one iteration per DP sync on every rank (dp_attention/sync.py).

`event_loop_normal`: recv → schedule → DP sync → forward → process. `event_loop_overlap`: launch
step N, then process step N-1's result while N runs on the worker thread; two consecutive prefills
are not overlapped, so the first one's tokens go out before the second runs. Both return, with
nothing in flight, at the same iteration on every rank once every rank asked to stop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from moeserve.core import ForwardMode

if TYPE_CHECKING:
    from moeserve.scheduler.batch import ScheduledBatch
    from moeserve.scheduler.scheduler import Scheduler

PREFILLS = (ForwardMode.EXTEND, ForwardMode.MIXED)  # steps whose first tokens go out at once


def event_loop_normal(sched: Scheduler, should_stop: Callable[[], bool]) -> None:
    tl = sched.timeline  # laps: scheduler/timeline.py (a no-op unless MOESERVE_STEP_TIMELINE)
    while True:
        tl.begin()
        sched._recv(may_block=True)
        batch, info = sched.next_synced_batch(should_stop())
        sched.ops.run_lockstep(info)
        tl.lap("sched")
        if batch is None:
            sched.cache.free_deferred_rows()
            tl.end(None, 0)
            if info.all_stop:
                return
            continue
        out = sched.worker.submit(batch.forward_input).result()
        tl.lap("fwd")
        sched.process_result(batch, out)
        tl.lap("proc")
        tl.end(batch.mode.name, len(batch.reqs))


def event_loop_overlap(sched: Scheduler, should_stop: Callable[[], bool]) -> None:
    last: tuple[ScheduledBatch, object] | None = None
    tl = sched.timeline
    while True:
        tl.begin()
        if last is not None and sched.spec is not None:
            # speculating: the next step's positions follow from this one's accepted lengths
            sched.process_result(last[0], last[1].result())
            last = None
        sched._recv(may_block=last is None)
        batch, info = sched.next_synced_batch(should_stop())
        if last is not None and sched.ops.lockstep_due(info):  # nothing may be in flight
            sched.process_result(last[0], last[1].result())
            last = None
        sched.ops.run_lockstep(info)
        if last is not None and batch is not None and (
                batch.mode in PREFILLS and last[0].mode in PREFILLS):
            sched.process_result(last[0], last[1].result())  # protect time-to-first-token
            last = None
        future = sched.worker.submit(batch.forward_input) if batch is not None else None
        if last is not None:
            sched.process_result(last[0], last[1].result())
        elif future is None:
            sched.cache.free_deferred_rows()  # nothing in flight
        last = (batch, future) if batch is not None else None
        tl.end(batch.mode.name if batch is not None else None, len(batch.reqs) if batch else 0)
        if batch is None and info.all_stop:
            return  # the same iteration on every rank: nothing is in flight anywhere
