"""Elastic EP's death by silence (elastic/supervisor.py), on a fake clock: a rank process that is
stopped (SIGSTOP: alive, but its heartbeat stands still) or stuck (it heartbeats, but neither
fails nor progresses while its peers' collectives fail) is killed by the launcher, so it cannot
come back half-alive, and then treated as dead: the next membership leaves it out, the DP
controller is told (RankDown) and the live-rank count follows. The rank processes are real
(forked sleepers) so the kill and the exit it causes are the operating system's."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest
from prometheus_client import CollectorRegistry

from moeserve.config import compose
from moeserve.elastic.membership import MembershipStore, connect_store
from moeserve.elastic.metrics import ElasticMetrics
from moeserve.elastic.supervisor import ElasticSupervisor, host_store
from moeserve.ipc.messages import RankDown
from moeserve.ipc.queues import Endpoints, PullQueue
from moeserve.procs.children import Child, ProcessGroup
from moeserve.procs.rendezvous import free_tcp_port

TIMEOUT_S = 3.0


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def deployment():
    """A supervisor over 4 forked sleeper 'ranks', its store, the controller's inbox, a clock."""
    cfg = compose(["parallel.tp_size=4", "parallel.dp_size=4", "parallel.elastic_ep=true",
                   f"parallel.elastic_timeout_s={TIMEOUT_S}",
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
    controller = PullQueue(ctx, endpoints.scheduler_in, RankDown)
    live: list[int] = []
    others: list[Child] = []
    clock = FakeClock()
    sup = ElasticSupervisor(cfg, procs, endpoints,
                            ElasticMetrics(CollectorRegistry(), 4), others.append,
                            lambda rank: pytest.fail(f"relaunch of {rank} without relaunch on"),
                            live.append, clock=clock)
    store = MembershipStore(connect_store(cfg.parallel.dist_init_addr))
    yield sup, store, controller, clock, procs, live, others
    for c in procs.children:
        os.kill(c.process.pid, signal.SIGKILL)
        c.process.join(5)
    controller.socket.close()
    ctx.term()
    del server


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
