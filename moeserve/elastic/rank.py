"""A scheduler rank under elastic EP: heartbeats, and a failed collective turned into a recovery.

`run` drives the scheduler's loop. When a collective fails (a peer died or stayed silent past
`parallel.elastic_timeout_s`) or every rank agreed to regroup (a relaunched rank joins), the rank:
1. waits for its forward thread (the failed step must be over), requeues its requests
   (requeue.py: each resumes from its prompt and the tokens already streamed);
2. reports the failure, destroys the broken groups, waits for the next membership the launcher
   publishes (membership.py) and joins its groups (group.py);
3. re-places the experts over the members (placement.py, weights.py), rebuilds the dispatcher,
   location and recorder, and goes back to serving; its first step is reported for the
   recovery-time figure.
A relaunched rank loads its weights first (original layout, no groups), says it is ready, and
joins at the next membership like the others.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from moeserve.config import MoeserveConfig, loads_mtp_layer
from moeserve.core import ForwardMode
from moeserve.distributed import ParallelMesh
from moeserve.dp_attention.sync import GlobalBatchInfo
from moeserve.elastic.group import form_group, is_comm_failure, leave_group, set_timeout
from moeserve.elastic.membership import Membership, MembershipStore, connect_store
from moeserve.elastic.placement import target_placement
from moeserve.elastic.requeue import requeue_all
from moeserve.elastic.weights import apply_placement, gather_holdings, holdings_of
from moeserve.env import env

if TYPE_CHECKING:
    from moeserve.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0  # collectives before serving: ranks load their weights at their pace
JOIN_WAIT_S = 600.0  # the longest a rank waits for the launcher's next membership


class RegroupDue(Exception):
    """Raised at the step at which every rank agreed to leave for a new membership."""


class ElasticRank:
    def __init__(self, cfg: MoeserveConfig, rank: int, device: torch.device):
        p = cfg.parallel
        self.cfg, self.rank, self.device = cfg, rank, device
        self.timeout_s = p.elastic_timeout_s
        self.join_timeout_s = max(30.0, 4 * self.timeout_s)
        self.store = MembershipStore(connect_store(p.dist_init_addr))
        self.membership: Membership = self.store.wait_newer(-1, JOIN_WAIT_S)
        self.newcomer = rank not in self.membership.ranks  # relaunched after a death
        self.regroup_target = -1  # generation a Regroup message announced
        self._first_step_due = False
        self.prefill_pause_s = env().test_prefill_pause_s
        self.sched: Scheduler | None = None
        threading.Thread(target=self._heartbeat, name="elastic-heartbeat", daemon=True).start()

    def _heartbeat(self) -> None:
        """Beat every timeout/4; a failed beat (the store slow or briefly unreachable) is logged
        and retried, never allowed to end the thread: a silent rank is killed as stuck."""
        store = MembershipStore(connect_store(self.cfg.parallel.dist_init_addr))
        while True:
            try:
                store.beat(self.rank)
            except Exception as e:  # noqa: BLE001 -- any store error: retry next beat
                logger.warning("elastic: rank %d heartbeat failed: %s", self.rank, e)
            time.sleep(self.timeout_s / 4)

    # ---- start-up -------------------------------------------------------------------------------
    def initial_mesh(self) -> ParallelMesh:
        """A first-generation rank joins its groups now; a relaunched one gets the original
        layout without groups (it builds its model as rank `rank` of the full deployment, then
        joins in `attach`)."""
        w = self.cfg.parallel.world_size
        mesh = ParallelMesh(rank=self.rank, world_size=w, dp_rank=self.rank, dp_size=w,
                            ep_rank=self.rank, ep_size=w, device=self.device)
        if not self.newcomer:
            form_group(mesh, self.store.store, self.membership, self.rank, STARTUP_TIMEOUT_S)
        return mesh

    def attach(self, sched: Scheduler) -> None:
        """Take over `sched` (built on initial_mesh); a relaunched rank joins the group here."""
        self.sched = sched
        sched.elastic = self
        runner = sched.runner
        par = runner.moe_parallel
        from moeserve.runtime.moe_setup import num_logical_experts

        self.num_logical = num_logical_experts(runner.hf_config) or 0
        self.num_layers = runner.hf_config.num_hidden_layers + int(loads_mtp_layer(self.cfg))
        w = self.cfg.parallel.world_size
        if par.location is not None:
            self.original = par.location.physical_to_logical.cpu().clone()
        else:
            self.original = torch.arange(self.num_logical).expand(self.num_layers, -1).clone()
        self.original_slots = self.original.shape[1] // w if self.num_logical else 0
        sched.stats.update(elastic_generation=self.membership.generation,
                           elastic_slots=self.original_slots, elastic_placement="original")
        if self.newcomer:
            self.store.mark_ready(self.rank)
            logger.info("elastic: relaunched rank %d loaded its weights; waiting to join",
                        self.rank)
            self._join(self.membership.generation)
            self._first_step_due = True
        else:
            dist.barrier(group=sched.mesh.cpu_group)  # every rank has loaded (long timeout)
            set_timeout(sched.mesh, self.timeout_s)

    # ---- the loop -------------------------------------------------------------------------------
    def run(self, should_stop: Callable[[], bool]) -> None:
        while True:
            try:
                self.sched.run_forever(should_stop)
                return
            except RegroupDue:
                self._recover(f"generation {self.regroup_target} published", failed=False)
            except Exception as e:
                if not is_comm_failure(e):
                    raise
                self._recover(f"{type(e).__name__}: {str(e).splitlines()[0][:200]}",
                              failed=True)

    # hooks called by the scheduler (scheduler.py, ops.py)
    def on_regroup(self, generation: int) -> None:
        self.regroup_target = max(self.regroup_target, generation)

    @property
    def regroup_pending(self) -> bool:
        return self.regroup_target > self.membership.generation

    def regroup_now(self) -> None:
        raise RegroupDue()

    def after_sync(self, info: GlobalBatchInfo) -> None:
        if self._first_step_due:
            self._first_step_due = False
            self.store.first_step(self.membership.generation, self.rank, time.time())
        if self.prefill_pause_s > 0 and info.global_mode == ForwardMode.EXTEND:
            self._test_prefill_pause()

    def _test_prefill_pause(self) -> None:
        """MOESERVE_TEST_PREFILL_PAUSE_S (env.py): the group's last rank stops in a prefill step
        (its peers wait in the step's collectives), once per deployment."""
        mesh = self.sched.mesh
        if mesh.rank != mesh.world_size - 1 or self.store.store.add("elastic/test_pause", 1) > 1:
            self.prefill_pause_s = 0.0
            return
        logger.warning("MOESERVE_TEST_PREFILL_PAUSE_S: rank %d pauses %.1f s in a prefill step",
                       self.rank, self.prefill_pause_s)
        time.sleep(self.prefill_pause_s)
        self.prefill_pause_s = 0.0

    # ---- recovery -------------------------------------------------------------------------------
    def _recover(self, cause: str, failed: bool) -> None:
        sched, gen = self.sched, self.membership.generation
        sched.worker.drain()
        requeued = requeue_all(sched)
        for msg in sched.ops.rebalance_requests:  # its peers changed: it cannot finish as asked
            sched.io.send_control(msg, False, {"error": f"EPLB rebalance interrupted by a "
                                               f"membership change ({cause}); ask again"})
        sched.ops.rebalance_requests = []
        (logger.warning if failed else logger.info)(
            "elastic: rank %d leaves generation %d (%s); %d running request(s) requeued",
            self.rank, gen, cause, requeued)
        if failed:
            self.store.report_failure(gen, self.rank, cause)
        leave_group()
        self._join(gen)
        self._first_step_due = True

    def _join(self, after: int) -> None:
        """Join the first membership newer than `after` that has this rank (collective)."""
        while True:
            m = self.store.wait_newer(after, JOIN_WAIT_S)
            after = m.generation
            if self.rank not in m.ranks:
                if self.newcomer:
                    continue  # published before this rank was ready
                logger.error("elastic: rank %d is not a member of generation %d (%s); exiting",
                             self.rank, m.generation, m.cause)
                logging.shutdown()
                os._exit(1)
            t0 = time.monotonic()
            try:
                form_group(self.sched.mesh, self.store.store, m, self.rank, self.join_timeout_s)
                stats = self._place_experts(m)
                set_timeout(self.sched.mesh, self.timeout_s)
            except Exception as e:
                if not is_comm_failure(e):
                    raise
                logger.warning("elastic: rank %d could not join generation %d: %s", self.rank,
                               m.generation, str(e).splitlines()[0][:200])
                self.store.report_failure(m.generation, self.rank, str(e)[:200])
                leave_group()
                continue
            self.membership, self.newcomer = m, False
            logger.info("elastic: rank %d joined generation %d as %d of %d (ranks %s) in "
                        "%.2f s; experts: %s", self.rank, m.generation, m.index(self.rank),
                        len(m.ranks), list(m.ranks), time.monotonic() - t0, dict(stats))
            return

    def _place_experts(self, m: Membership) -> dict:
        """The placement for `m` over the new group, weights moved, dispatcher rebuilt."""
        from moeserve.eplb.location import ExpertLocation
        from moeserve.runtime.moe_setup import make_dispatcher, make_recorder

        runner, mesh = self.sched.runner, self.sched.mesh
        par = runner.moe_parallel
        runner.graph_runner = runner.extend_graphs = None  # they captured the old group
        if not par.experts_by_layer:
            return {}
        n, me = len(m.ranks), m.index(self.rank)
        width = max(self.num_logical, self.original_slots)
        mine = holdings_of(par.experts_by_layer, self.num_layers, width)
        holdings = gather_holdings(mine, n, mesh.cpu_group)
        load = self._logical_load(mesh)
        groups = getattr(runner.hf_config, "n_group", 1) or 1
        phy2log = target_placement(load, m.ranks, self.cfg.parallel.world_size, self.original,
                                   self.original_slots, groups)
        slots = phy2log.shape[1] // n
        stats = apply_placement(par.experts_by_layer, phy2log, slots, holdings, me,
                                mesh.world_group, runner.model, self.cfg.model.path)
        par.location = ExpertLocation.from_physical_to_logical(
            phy2log, self.num_logical, n, 1, me, device=self.device,
            metadata={"source": f"elastic generation {m.generation}"})
        par.ep_rank, par.ep_size = me, n
        recording = runner.recorder is not None and getattr(runner.recorder, "recording", False)
        par.recorder = make_recorder(self.cfg, par, self.num_layers, self.num_logical,
                                     self.device)
        if recording:
            par.recorder.start()
        if runner.recorder is not None:
            runner.recorder = par.recorder
        par.dispatcher = make_dispatcher(self.cfg, mesh, phy2log.shape[1], runner.hf_config,
                                         runner.dtype)
        self.sched.stats.update(elastic_generation=m.generation, elastic_slots=slots,
                                elastic_placement="original" if torch.equal(
                                    phy2log, self.original) else "eplb")
        return stats

    def _logical_load(self, mesh: ParallelMesh) -> torch.Tensor:
        """Tokens per logical expert recorded so far on the members: [L, E] (collective)."""
        load = torch.zeros(self.num_layers, self.num_logical, dtype=torch.int64)
        rec, loc = self.sched.runner.recorder, self.sched.runner.moe_parallel.location
        if rec is not None and loc is not None and not self.newcomer:
            counts = rec.physical_counts().to("cpu", torch.int64)
            load.scatter_add_(1, loc.physical_to_logical.cpu()[:, : counts.shape[1]], counts)
        dist.all_reduce(load, group=mesh.cpu_group)
        return load
