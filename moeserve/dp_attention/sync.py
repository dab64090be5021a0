"""Per-step lockstep of data-parallel ranks: one all-gather of a small int vector per step.

Every rank runs the same sequence of forwards so that the collectives inside MoE layers match: a
rank with no work runs an IDLE batch (zero tokens) whenever any other rank runs something. A rank
never skips a collective.

NOTE (the invariant, kept by Scheduler.next_synced_batch and its loops): each loop iteration of
every rank calls `dp_sync` exactly once, and everything that decides a collective afterwards (run
a forward or not, its global mode, TBO split, a lockstep op such as an EPLB rebalance, stopping)
is a function of the gathered `GlobalBatchInfo` alone, which is the same on every rank. Local
events (aborts, retractions, grammar parking, speculation step-asides, admission results) may
change only what a rank brings to the next sync, never whether it takes part. A rank that has
work yet schedules nothing stays in lockstep but stalls the deployment: the watchdog reports both
(dp_attention/watchdog.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from moeserve.core import ForwardMode
from moeserve.distributed import ParallelMesh
from moeserve.dp_attention.watchdog import RankState
from moeserve.tbo.strategy import decide

NO_BATCH = 0  # mode slot when the rank has nothing to run
OP_REBALANCE = 1  # an EPLB rebalance was requested
OP_REGROUP = 2  # elastic EP: a new membership (a rank rejoining) is published


@dataclass(frozen=True)
class GlobalBatchInfo:
    num_tokens: list[int]  # per rank
    modes: list[int]  # ForwardMode value per rank, NO_BATCH when idle
    stop: list[bool]  # the rank's caller wants the loop to end (Engine runs)
    ops: list[int]  # per rank: bitmask of pending lockstep operations (OP_*)
    tbo_votes: list[int]  # per rank: two-batch-overlap vote (tbo/strategy.py: NO_VOTE/WANT/VETO)
    loads: list[tuple[int, int, int]]  # per rank: (syncs entered, waiting, running), for logs

    @property
    def any_work(self) -> bool:
        return any(m != NO_BATCH for m in self.modes)

    @property
    def all_stop(self) -> bool:
        return all(self.stop) and not self.any_work

    def all_have(self, op: int) -> bool:
        """Every rank has `op` pending: they run it now, at the same step."""
        return all(o & op for o in self.ops)

    @property
    def tbo_split(self) -> bool:
        """Every rank runs this step as two micro-batches (the same answer on every rank)."""
        return decide(self.tbo_votes)

    @property
    def global_mode(self) -> ForwardMode:
        """EXTEND when any rank extends (DeepEP normal mode), else DECODE (a speculative verify
        step runs as a decode batch of one-token queries)."""
        decode_like = (NO_BATCH, ForwardMode.DECODE, ForwardMode.TARGET_VERIFY)
        extend = any(m not in decode_like for m in self.modes)
        return ForwardMode.EXTEND if extend else ForwardMode.DECODE


    def rank_states(self) -> list[RankState]:
        return [RankState(r, load[0], _mode_name(m), n, load[1], load[2], op)
                for r, (n, m, op, load) in enumerate(zip(self.num_tokens, self.modes, self.ops,
                                                         self.loads))]


def _mode_name(mode: int) -> str:
    return "none" if mode == NO_BATCH else ForwardMode(mode).name


def dp_sync(mesh: ParallelMesh, num_tokens: int, mode: ForwardMode | None, stop: bool,
            ops: int = 0, tbo_vote: int = 0,
            load: tuple[int, int, int] = (0, 0, 0)) -> GlobalBatchInfo:
    """Gather (tokens, mode, stop, ops, tbo vote, load) from every rank in one collective; a
    single-rank mesh answers locally."""
    local = [num_tokens, int(mode) if mode is not None else NO_BATCH, int(stop), ops, tbo_vote,
             *load]
    if not mesh.distributed:
        rows = [local]
    else:
        mine = torch.tensor(local, dtype=torch.int64)
        out = torch.empty(mesh.world_size * len(local), dtype=torch.int64)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, mine, group=mesh.cpu_group)
        rows = out.view(mesh.world_size, len(local)).tolist()
    return GlobalBatchInfo([r[0] for r in rows], [r[1] for r in rows],
                           [bool(r[2]) for r in rows], [r[3] for r in rows],
                           [r[4] for r in rows], [tuple(r[5:8]) for r in rows])
