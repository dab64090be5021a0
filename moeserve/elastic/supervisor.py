"""The launcher's side of elastic EP: notices a rank's loss, publishes the next membership,
routes around the rank, relaunches it, and reports each recovery.

One thread polls every POLL_S:
- a rank process that exited (sentinel) is lost at once; one whose heartbeat counter stood still
  for `parallel.elastic_timeout_s` is killed (it may be stopped or stuck) and then lost; when a
  rank reported a failed collective and some member neither reported one nor died within two
  timeouts, that member is stuck and is killed the same way; when every member reported a
  failure and none died, the same members regroup;
- a loss publishes generation g+1 without the rank (membership.py), tells the DP controller
  (RankDown: stop routing, hand its requests back for a retry), and, with
  `parallel.elastic_relaunch`, starts the rank again; once the relaunched process has loaded
  its weights and generation g+1 serves (every member took a step on it), generation g+2 with
  it is published and the serving ranks are asked to regroup (Regroup, taken at a step they
  agree on);
- when every member of a generation reported its first step, one log line gives the recovery
  time (event to first step), and /metrics follows (metrics.py).
Any other child's death still takes the server down (procs/supervise.py).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable

import zmq

from moeserve.config import MoeserveConfig
from moeserve.elastic.membership import Membership, MembershipStore, connect_store
from moeserve.elastic.metrics import ElasticMetrics
from moeserve.ipc.messages import RankDown, RankUp, Regroup
from moeserve.ipc.queues import Endpoints, PushQueue
from moeserve.procs.children import Child, ProcessGroup

logger = logging.getLogger(__name__)

POLL_S = 0.05
MAX_RELAUNCHES = 3  # per rank, in a row without a successful join


def host_store(cfg: MoeserveConfig):
    """The launcher's TCPStore at parallel.dist_init_addr, with generation 0 = every rank
    published (keep the returned object alive: it is the store's server)."""
    store = connect_store(cfg.parallel.dist_init_addr, master=True)
    ranks = tuple(range(cfg.parallel.world_size))
    MembershipStore(store).publish(Membership(0, ranks, "start", time.time()))
    return store


def rank_of(child: Child) -> int | None:
    prefix = "scheduler-"
    return int(child.name[len(prefix):]) if child.name.startswith(prefix) else None


def exit_cause(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


class ElasticSupervisor:
    def __init__(self, cfg: MoeserveConfig, procs: ProcessGroup, endpoints: Endpoints,
                 metrics: ElasticMetrics, on_other_death: Callable[[Child], None],
                 relaunch: Callable[[int], None], set_live_ranks: Callable[[int], None],
                 clock: Callable[[], float] = time.monotonic):
        p = cfg.parallel
        self.clock = clock  # for the heartbeat and stuck-member deadlines (tests pass a fake)
        self.cfg, self.procs, self.metrics = cfg, procs, metrics
        self.on_other_death, self.relaunch, self.set_live_ranks = (on_other_death, relaunch,
                                                                   set_live_ranks)
        self.timeout_s = p.elastic_timeout_s
        self.store = MembershipStore(connect_store(p.dist_init_addr))
        self.current: Membership = self.store.latest()
        self.ctx = zmq.Context()
        self.to_controller = PushQueue(self.ctx, endpoints.scheduler_in)
        self.to_ranks = [PushQueue(self.ctx, addr) for addr in endpoints.rank_in]
        self.handled: set[int] = set()  # pids whose exit was dealt with
        self.fenced: dict[int, str] = {}  # rank -> why it was killed
        self.beats: dict[int, tuple[int, float]] = {}  # rank -> (counter, when it last moved)
        self.failures: dict[int, float] = {}  # members that reported a failed collective
        self.joining: dict[int, int] = {}  # relaunched rank -> relaunches in a row
        self.pending: dict[int, Membership] = {}  # generation -> waiting for first steps
        self._stop = threading.Event()

    def start(self) -> None:
        threading.Thread(target=self._run, name="elastic-supervisor", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            if self.procs.stopping.is_set():
                return
            try:
                self._poll()
            except Exception:
                logger.exception("elastic supervisor")

    def _poll(self) -> None:
        now = self.clock()
        for child in list(self.procs.children):
            if child.process.is_alive() or child.process.pid in self.handled:
                continue
            self.handled.add(child.process.pid)
            rank = rank_of(child)
            if rank is None:
                self.on_other_death(child)
                return
            self.procs.children.remove(child)
            child.process.join(0)
            self._lost(rank, self.fenced.pop(rank, exit_cause(child.process.exitcode)), child)
        for rank in self.current.ranks:
            self._check_heartbeat(rank, now)
        self._check_failures(now)
        self._check_first_steps()
        self._check_joining()  # after: it waits for the current generation to serve

    # ---- losing a rank ----------------------------------------------------------------------
    def _kill(self, rank: int, why: str) -> None:
        pid = next((c.process.pid for c in self.procs.children if rank_of(c) == rank), None)
        if pid is None or rank in self.fenced:
            return
        logger.error("elastic: rank %d %s; killing it (pid %d)", rank, why, pid)
        self.fenced[rank] = why
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def _check_heartbeat(self, rank: int, now: float) -> None:
        count = self.store.beats(rank)
        last = self.beats.get(rank)
        if last is None or count != last[0]:
            self.beats[rank] = (count, now)
        elif count > 0 and now - last[1] > self.timeout_s:
            self._kill(rank, f"sent no heartbeat for {now - last[1]:.1f} s")

    def _check_failures(self, now: float) -> None:
        g = self.current.generation
        for rank in self.current.ranks:
            if rank not in self.failures and self.store.failure(g, rank) is not None:
                self.failures[rank] = now
        if not self.failures:
            return
        silent = [r for r in self.current.ranks if r not in self.failures]
        if not silent:
            first = min(self.failures)
            self._publish(self.current.ranks, f"collectives failed with every rank alive "
                          f"(rank {first}: {self.store.failure(g, first)})", time.time())
        elif now - min(self.failures.values()) > 2 * self.timeout_s:
            for rank in silent:
                self._kill(rank, f"neither failed nor progressed in generation {g} while "
                                 f"its peers' collectives failed")

    def _lost(self, rank: int, cause: str, child: Child) -> None:
        t = time.time()
        self.beats.pop(rank, None)
        if rank not in self.current.ranks:  # a relaunched rank died before joining
            logger.error("elastic: relaunched rank %d %s before it joined", rank, cause)
            self._maybe_relaunch(rank)
            return
        members = tuple(r for r in self.current.ranks if r != rank)
        logger.error("elastic: rank %d lost (%s); %d rank(s) go on: %s", rank, cause,
                     len(members), list(members))
        self.metrics.rank_failures.inc()
        self.metrics.ranks_alive.set(len(members))
        if not members:
            logger.error("elastic: no rank is left; shutting the server down")
            self.on_other_death(child)
            return
        self._publish(members, f"rank {rank} {cause}", t)
        self.to_controller.put(RankDown(rank=rank, cause=cause))
        self.set_live_ranks(len(members))
        self._maybe_relaunch(rank)

    def _publish(self, ranks: tuple[int, ...], cause: str, event_time: float,
                 joining: tuple[int, ...] = ()) -> None:
        m = Membership(self.current.generation + 1, tuple(sorted(ranks)), cause, event_time,
                       joining)
        self.store.publish(m)
        self.current, self.failures = m, {}
        self.pending[m.generation] = m
        logger.info("elastic: generation %d published: ranks %s (%s)", m.generation,
                    list(m.ranks), cause)

    # ---- rejoin -----------------------------------------------------------------------------
    def _maybe_relaunch(self, rank: int) -> None:
        if not self.cfg.parallel.elastic_relaunch:
            return
        tries = self.joining.get(rank, 0)
        if tries >= MAX_RELAUNCHES:
            logger.error("elastic: rank %d failed %d relaunches in a row; not relaunching it",
                         rank, tries)
            self.joining.pop(rank, None)
            return
        self.joining[rank] = tries + 1
        self.store.mark_ready(rank, False)
        logger.info("elastic: relaunching rank %d", rank)
        self.metrics.relaunches.inc()
        self.relaunch(rank)

    def _check_joining(self) -> None:
        """Ready relaunched ranks join, all in one generation, once the current one serves
        (each member took its first step on it). Published while the survivors still form the
        current one, the rejoin generation split them: a survivor still leaving the old group
        (waiting out `elastic_timeout_s`) skipped to the newest generation while the others
        waited for it in the one before, both sides timed out and were killed as stuck (a
        relaunch ready within about that timeout of the loss did this in 1 run of 3)."""
        ready = [r for r in self.joining if self.store.is_ready(r)]
        if not ready or self.current.generation in self.pending:
            return
        for rank in ready:
            self.store.mark_ready(rank, False)
        serving = self.current.ranks
        cause = (f"rank {ready[0]} rejoins" if len(ready) == 1 else
                 f"ranks {sorted(ready)} rejoin")
        self._publish((*serving, *ready), cause, time.time(), joining=tuple(sorted(ready)))
        for r in serving:
            self.to_ranks[r].put(Regroup(generation=self.current.generation))

    def _check_first_steps(self) -> None:
        for g, m in list(self.pending.items()):
            if g < self.current.generation:
                del self.pending[g]  # superseded before it served
                continue
            steps = [self.store.first_step_of(g, r) for r in m.ranks]
            if any(s is None for s in steps):
                continue
            del self.pending[g]
            if g == 0:
                continue
            took = min(steps) - m.event_time
            kind = "rejoin" if m.joining else "failure"
            # ranks_alive first: a reader that sees the recovery counted sees its membership too
            self.metrics.ranks_alive.set(len(m.ranks))
            self.metrics.recovery_seconds.observe(took)
            self.metrics.last_recovery_seconds.set(took)
            self.metrics.recoveries.labels(kind).inc()
            for rank in m.joining:
                self.joining.pop(rank, None)
                self.to_controller.put(RankUp(rank=rank))
            self.set_live_ranks(len(m.ranks))
            logger.warning("elastic: generation %d serving on ranks %s: first step %.2f s after "
                           "%s", g, list(m.ranks), took, m.cause)
