"""Control requests a scheduler rank answers (cache flush, server info, expert-load recording) and
lockstep operations that every rank must run at the same step (live EPLB rebalance).

A lockstep op is flagged in the per-step DP sync; it runs once every rank has it pending (or, for
`eplb.rebalance_interval`, at a step count every rank shares), between two forwards.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from moeserve.dp_attention.sync import OP_REBALANCE, OP_REGROUP, GlobalBatchInfo
from moeserve.ipc.messages import ControlReq

if TYPE_CHECKING:
    from moeserve.scheduler.scheduler import Scheduler

Reply = tuple[bool, dict]


class SchedulerOps:
    def __init__(self, sched: Scheduler):
        self.sched = sched
        self.rebalance_requests: list[ControlReq] = []  # answered once the rebalance ran
        self.synced_steps = 0  # identical on every rank: drives eplb.rebalance_interval
        self._handlers: dict[str, Callable[[], Reply]] = {
            "flush_cache": self._flush_cache,
            "server_info": lambda: (True, {**sched.load(), "memory_clean": sched.is_memory_clean()}),
            "expert_record_start": self._record_start, "expert_record_stop": self._record_stop,
            "expert_record_dump": self._record_dump}

    # ---- control requests (answered right away) ---------------------------------------------
    def handle(self, msg: ControlReq) -> None:
        io = self.sched.io
        if msg.op == "rebalance":
            if self.sched.runner.moe_parallel.location is None:
                io.send_control(msg, False, {"error": "EPLB is off: set "
                                             "eplb.num_redundant_experts or init_placement"})
            else:
                self.rebalance_requests.append(msg)  # runs at the next step all ranks agree on
            return
        handler = self._handlers.get(msg.op)
        if handler is None:
            io.send_control(msg, False, {"error": f"unknown op {msg.op!r}"})
            return
        ok, data = handler()
        io.send_control(msg, ok, data)

    def _flush_cache(self) -> Reply:
        s = self.sched
        return (not s.running and not s.waiting and s.cache.flush()), {}

    def _recorder(self):
        return self.sched.runner.recorder

    def _record_start(self) -> Reply:
        rec = self._recorder()
        if rec is None:
            return False, {"error": "not a MoE model"}
        rec.reset()
        rec.start()
        return True, {}

    def _record_stop(self) -> Reply:
        rec = self._recorder()
        if rec is None:
            return False, {"error": "not a MoE model"}
        rec.stop()
        return True, {}

    def _record_dump(self) -> Reply:
        """This rank's counts; the caller sums the ranks' counts and writes the dump file."""
        rec = self._recorder()
        if rec is None:
            return False, {"error": "not a MoE model"}
        loc = rec.location
        return True, {"counts": rec.physical_counts().cpu().tolist(), "steps": rec.steps,
                      "topk": rec.topk, "start_time": rec.start_time,
                      "phy2log": None if loc is None else loc.physical_to_logical.cpu().tolist(),
                      "num_logical": rec.num_physical if loc is None else loc.num_logical,
                      "ep_size": self.sched.mesh.ep_size,
                      "num_nodes": self.sched.cfg.parallel.nnodes}

    # ---- lockstep operations ----------------------------------------------------------------
    def pending(self) -> int:
        """Bitmask for the DP sync: the lockstep ops this rank has been asked to run."""
        elastic = self.sched.elastic
        regroup = OP_REGROUP if elastic is not None and elastic.regroup_pending else 0
        return (OP_REBALANCE if self.rebalance_requests else 0) | regroup

    def lockstep_due(self, info: GlobalBatchInfo) -> bool:
        interval = self.sched.cfg.eplb.rebalance_interval
        periodic = (interval > 0 and info.any_work and self.synced_steps % interval == 0
                    and self.sched.runner.moe_parallel.location is not None)
        return info.all_have(OP_REBALANCE) or info.all_have(OP_REGROUP) or periodic

    def run_lockstep(self, info: GlobalBatchInfo) -> None:
        """Every rank decides from the same sync result, so all rebalance at the same step
        (and, under elastic EP, all leave for a new membership at the same step)."""
        if not self.lockstep_due(info):
            return
        if info.all_have(OP_REGROUP):
            self.sched.elastic.regroup_now()  # raises: the loop ends, nothing in flight
        from moeserve.eplb.rebalancer import rebalance

        s = self.sched
        par = s.runner.moe_parallel
        result = rebalance(par.experts_by_layer, par.location, s.runner.recorder.physical_counts(),
                           s.mesh)
        s.stats["eplb_balancedness"] = result.balancedness_after
        s.stats["eplb_rebalances"] = s.stats.get("eplb_rebalances", 0) + 1
        for msg in self.rebalance_requests:
            s.io.send_control(msg, True, {"balancedness_before": result.balancedness_before,
                                          "balancedness_after": result.balancedness_after,
                                          "moved_slots": result.moved_slots})
        self.rebalance_requests = []
