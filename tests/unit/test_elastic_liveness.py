"""Elastic EP's death by silence (elastic/supervisor.py), on a fake clock: a rank process that is
stopped (SIGSTOP: alive, but its heartbeat stands still) or stuck (it heartbeats, but neither
fails nor progresses while its peers' collectives fail) is killed by the launcher, so it cannot
come back half-alive, and then treated as dead: the next membership leaves it out, the DP
controller is told (RankDown) and the live-rank count follows. The rank processes are real
(forked sleepers) so the kill and the exit it causes are the operating system's. Last, the
order of a rejoin: a relaunched rank is published only once the survivors serve."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import time
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from moeserve.config import compose
from moeserve.elastic.membership import MembershipStore, connect_store
from moeserve.elastic.metrics import ElasticMetrics
from moeserve.elastic.supervisor import ElasticSupervisor, host_store
from moeserve.ipc.messages import RankDown, RankUp, Regroup
from moeserve.ipc.queues import Endpoints, PullQueue
from moeserve.procs.children import Child, ProcessGroup
from moeserve.procs.rendezvous import free_tcp_port

TIMEOUT_S = 3.0


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@contextlib.contextmanager
def supervised(relaunch: bool):
    """A supervisor over 4 forked sleeper 'ranks', its store, the controller's inbox, a clock;
    with `relaunch`, parallel.elastic_relaunch is on and the ranks it relaunches are recorded
    (no process starts: the test plays the relaunched rank through the store)."""
    cfg = compose(["parallel.tp_size=4", "parallel.dp_size=4", "parallel.elastic_ep=true",
                   f"parallel.elastic_timeout_s={TIMEOUT_S}",
                   f"parallel.elastic_relaunch={str(relaunch).lower()}",
                   f"parallel.dist_init_addr=127.0.0.1:{free_tcp_port()}"])
    server = host_store(cfg)
    endpoints = Endpoints.fresh(4)
    procs = ProcessGroup()
    fork = mp.get_context("fork")
    for r in range(4):
        p = fork.Process(target=time.sleep, args=(120,), daemon=True)
        p.start()
        procs.children.append(Child(f"scheduler-{r}", p))
    import zmq

    ctx = zmq.Context()
    controller = PullQueue(ctx, endpoints.scheduler_in, RankDown | RankUp)
    ranks_in = [PullQueue(ctx, addr, Regroup) for addr in endpoints.rank_in]
    live: list[int] = []
    others: list[Child] = []
    relaunched: list[int] = []

    def on_relaunch(rank: int) -> None:
        if not relaunch:
            pytest.fail(f"relaunch of {rank} without relaunch on")
        relaunched.append(rank)

    clock = FakeClock()
    sup = ElasticSupervisor(cfg, procs, endpoints,
                            ElasticMetrics(CollectorRegistry(), 4), others.append,
                            on_relaunch, live.append, clock=clock)
    store = MembershipStore(connect_store(cfg.parallel.dist_init_addr))
    try:
        yield SimpleNamespace(sup=sup, store=store, controller=controller, clock=clock,
                              procs=procs, live=live, others=others, relaunched=relaunched,
                              ranks_in=ranks_in)
    finally:
        for c in procs.children:
            os.kill(c.process.pid, signal.SIGKILL)
            c.process.join(5)
        for q in (controller, *ranks_in):
            q.socket.close()
        ctx.term()
        del server


@pytest.fixture
def deployment():
    with supervised(relaunch=False) as d:
        yield d.sup, d.store, d.controller, d.clock, d.procs, d.live, d.others


def pid_of(procs: ProcessGroup, rank: int) -> int:
    return next(c.process.pid for c in procs.children if c.name == f"scheduler-{rank}")


def step(sup, store, clock, seconds: float, beating=(0, 1, 2, 3)) -> None:
    """`seconds` of fake time in poll-sized ticks; the ranks in `beating` heartbeat each tick."""
    for _ in range(int(seconds / 0.25)):
        for r in beating:
            store.beat(r)
        clock.now += 0.25
        sup._poll()


def wait_reaped(sup, procs, pid: int) -> None:
    """Real time for the SIGKILL to land; the supervisor sees the exit on its next poll."""
    deadline = time.monotonic() + 10
    while any(c.process.pid == pid for c in procs.children):
        assert time.monotonic() < deadline, "the killed rank never showed as exited"
        time.sleep(0.05)
        sup._poll()


def test_stopped_rank_is_killed_and_left_out(deployment):
    sup, store, controller, clock, procs, live, others = deployment
    step(sup, store, clock, 2 * TIMEOUT_S)  # everyone beats: nothing happens
    assert sup.current.generation == 0 and not sup.fenced
    victim = pid_of(procs, 2)
    os.kill(victim, signal.SIGSTOP)  # the process lives on, its heartbeat stops
    step(sup, store, clock, TIMEOUT_S - 0.5, beating=(0, 1, 3))
    assert sup.current.generation == 0 and not sup.fenced  # not yet past the timeout
    step(sup, store, clock, 1.0, beating=(0, 1, 3))
    assert "sent no heartbeat" in sup.fenced[2]
    wait_reaped(sup, procs, victim)
    with pytest.raises(ProcessLookupError):  # killed, not merely left out: it cannot come back
        os.kill(victim, 0)
    m = store.latest()
    assert (m.generation, m.ranks) == (1, (0, 1, 3))
    assert "rank 2 sent no heartbeat" in m.cause
    down = controller.get(timeout_ms=5000)
    assert isinstance(down, RankDown) and down.rank == 2 and "no heartbeat" in down.cause
    assert live == [3] and not others
    assert sup.metrics.ranks_alive._value.get() == 3
    # the survivors keep beating: no further loss
    step(sup, store, clock, 3 * TIMEOUT_S, beating=(0, 1, 3))
    assert store.latest().generation == 1 and controller.get(timeout_ms=50) is None


def test_rank_stuck_while_peers_fail_is_killed(deployment):
    """A rank whose heartbeat thread lives but whose loop is stuck (e.g. in a collective that
    never returns) is caught by its peers' failure reports: killed after two timeouts."""
    sup, store, controller, clock, procs, live, others = deployment
    victim = pid_of(procs, 3)
    step(sup, store, clock, 1.0)
    for r in (0, 1, 2):
        store.report_failure(0, r, "RuntimeError: Timed out waiting for rank 3")
    step(sup, store, clock, 2 * TIMEOUT_S - 0.5)
    assert not sup.fenced and sup.current.generation == 0
    step(sup, store, clock, 1.0)
    assert "neither failed nor progressed" in sup.fenced[3]
    wait_reaped(sup, procs, victim)
    m = store.latest()
    assert (m.generation, m.ranks) == (1, (0, 1, 2))
    assert controller.get(timeout_ms=5000).rank == 3 and live == [3] and not others


def test_every_member_failing_regroups_without_a_kill(deployment):
    sup, store, controller, clock, procs, live, others = deployment
    for r in range(4):
        store.report_failure(0, r, "Connection reset by peer")
    step(sup, store, clock, 0.25)
    m = store.latest()
    assert (m.generation, m.ranks) == (1, (0, 1, 2, 3)) and not sup.fenced
    assert all(c.process.is_alive() for c in procs.children)
    assert controller.get(timeout_ms=50) is None and live == [] and not others


def test_relaunched_rank_joins_once_the_survivors_serve():
    """A relaunched rank that is ready before the survivors have formed the generation that
    left it out must wait for them: published at once, its generation split the survivors (one
    still leaving the old group skipped to it, the others waited for it in the one before) and
    the stuck ranks were killed. Two ranks ready together join in one generation."""
    with supervised(relaunch=True) as d:
        sup, store, clock = d.sup, d.store, d.clock
        for rank in (2, 1):
            victim = pid_of(d.procs, rank)
            os.kill(victim, signal.SIGKILL)
            wait_reaped(sup, d.procs, victim)
        assert d.relaunched == [2, 1]
        assert (store.latest().generation, store.latest().ranks) == (2, (0, 3))
        store.mark_ready(2)  # rank 2's new process loaded its weights
        store.first_step(2, 0, time.time())  # rank 0 serves on generation 2, rank 3 not yet
        step(sup, store, clock, 1.0, beating=(0, 3))
        assert store.latest().generation == 2  # not over a generation still forming
        assert all(q.get(timeout_ms=0) is None for q in d.ranks_in)
        store.mark_ready(1)
        store.first_step(2, 3, time.time())  # generation 2 serves
        step(sup, store, clock, 0.25, beating=(0, 3))
        m = store.latest()
        assert (m.generation, m.ranks, m.joining) == (3, (0, 1, 2, 3), (1, 2))
        assert not store.is_ready(1) and not store.is_ready(2)
        for r in (0, 3):  # the serving ranks are asked to leave for it at an agreed step
            msg = d.ranks_in[r].get(timeout_ms=5000)
            assert isinstance(msg, Regroup) and msg.generation == 3
        for r in m.ranks:
            store.first_step(3, r, time.time())
        step(sup, store, clock, 0.25, beating=(0, 1, 2, 3))
        assert sup.metrics.recoveries.labels("rejoin")._value.get() == 1
        assert sup.metrics.ranks_alive._value.get() == 4
        msgs = [d.controller.get(timeout_ms=5000) for _ in range(4)]  # 2 RankDown, 2 RankUp
        assert sorted(m.rank for m in msgs if isinstance(m, RankUp)) == [1, 2]
