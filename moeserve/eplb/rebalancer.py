"""Live rebalance: new placement from the recorded load, expert weights moved between ranks with
batched point-to-point ops, placement tensors swapped in place — all ranks at the same step.

Called by every rank's scheduler between two forwards (nothing in flight), so the EP group is
free for the transfers and every rank sees the same load and computes the same placement.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moeserve.distributed import ParallelMesh
from moeserve.env import env
from moeserve.eplb.algorithm import balancedness, rank_load
from moeserve.eplb.location import ExpertLocation
from moeserve.layers.moe import MoEExperts

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RebalanceResult:
    balancedness_before: float  # mean over MoE layers of mean/max tokens per rank
    balancedness_after: float
    moved_slots: int  # local slots whose expert changed on this rank


def global_logical_load(counts: torch.Tensor, loc: ExpertLocation,
                        mesh: ParallelMesh) -> torch.Tensor:
    """Physical counts [L, P] of this rank → logical load [L, E] summed over all ranks."""
    counts = counts.detach().to("cpu", torch.int64).clone()
    if mesh.distributed:
        dist.all_reduce(counts, group=mesh.cpu_group)
    out = torch.zeros(counts.shape[0], loc.num_logical, dtype=torch.int64)
    return out.scatter_add_(1, loc.physical_to_logical.cpu(), counts)


def placement_balancedness(loc: ExpertLocation, load: torch.Tensor, layers: list[int]) -> float:
    per_rank = rank_load(loc.physical_to_logical.cpu(), load.float(), loc.logical_count.cpu(),
                         loc.ep_size)  # [L, ep]
    return float(balancedness(per_rank[layers]).mean())


def rebalance(experts: dict[int, MoEExperts], loc: ExpertLocation, counts: torch.Tensor,
              mesh: ParallelMesh, num_groups: int = 1) -> RebalanceResult:
    """Collective over the mesh: move weights to the EPLB placement for the recorded load and
    update `loc` in place. `experts` maps MoE layer id → this rank's experts module."""
    load = global_logical_load(counts, loc, mesh)  # [L, E]
    _test_pause(mesh)
    layers = sorted(experts)
    new = ExpertLocation.from_algorithm(load, loc.ep_size, loc.num_nodes,
                                        loc.num_physical - loc.num_logical, num_groups,
                                        loc.ep_rank, device=loc.physical_to_logical.device)
    before = placement_balancedness(loc, load, layers)
    moved = sum(_move_layer(experts[layer], loc, new, layer, mesh) for layer in layers)
    loc.update_(new)
    after = placement_balancedness(loc, load, layers)
    logger.info("EPLB rebalance: balancedness %.3f -> %.3f, %d local slots changed", before,
                after, moved)
    return RebalanceResult(before, after, moved)


def _test_pause(mesh: ParallelMesh) -> None:
    """MOESERVE_TEST_REBALANCE_PAUSE_S (fault tests): the last EP rank stops here a while."""
    pause = env().test_rebalance_pause_s
    if pause > 0 and mesh.ep_rank == mesh.ep_size - 1:
        logger.warning("MOESERVE_TEST_REBALANCE_PAUSE_S: EP rank %d pauses %.1f s before moving "
                       "expert weights", mesh.ep_rank, pause)
        deadline = time.monotonic() + pause
        while time.monotonic() < deadline:  # short sleeps: a stop request is seen at once
            time.sleep(0.05)


def _move_layer(ex: MoEExperts, old: ExpertLocation, new: ExpertLocation, layer: int,
                mesh: ParallelMesh) -> int:
    """Fill each local slot with its new logical expert, copied locally when this rank already
    holds it, else received from the rank of its lowest old replica (every rank agrees). Every
    per-slot tensor moves together (`MoEExperts.expert_params`: FP8 weights with their scales)."""
    old_p2l = old.physical_to_logical[layer].tolist()
    new_p2l = new.physical_to_logical[layer].tolist()
    per_rank = old.slots_per_rank
    source = {}  # logical expert → the old slot that serves it to other ranks
    for slot, e in enumerate(old_p2l):
        source.setdefault(e, slot)
    params = [_wire(p.data) for p in ex.expert_params()]  # [E_local, ...] each
    staged = [p.clone() for p in params]
    ops, recv = [], []
    for dst_slot, e in enumerate(new_p2l):
        dst_rank, src_slot = dst_slot // per_rank, source[e]
        src_rank = src_slot // per_rank
        mine = [s for s in range(per_rank * mesh.ep_rank, per_rank * (mesh.ep_rank + 1))
                if old_p2l[s] == e]
        if dst_rank == mesh.ep_rank:
            local = dst_slot - per_rank * mesh.ep_rank
            if mine:  # already here (maybe in another slot): copy
                for dst, src in zip(staged, params):
                    dst[local] = src[mine[0] - ex.first_expert]
            else:
                bufs = [torch.empty_like(t[local]) for t in staged]
                ops += [dist.P2POp(dist.irecv, b, src_rank, group=mesh.ep_group) for b in bufs]
                recv.append((local, bufs))
        elif src_rank == mesh.ep_rank and not _holds(old_p2l, dst_rank, per_rank, e):
            local_src = src_slot - ex.first_expert
            ops += [dist.P2POp(dist.isend, t[local_src].contiguous(), dst_rank,
                               group=mesh.ep_group) for t in params]
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    for local, bufs in recv:
        for dst, b in zip(staged, bufs):
            dst[local] = b
    for dst, src in zip(params, staged):
        dst.copy_(src)
    first = ex.first_expert
    changed = sum(a != b for a, b in zip(ex.slot_logical, new_p2l[first : first + ex.num_local]))
    ex.slot_logical = new_p2l[first : first + ex.num_local]
    return changed


def _wire(t: torch.Tensor) -> torch.Tensor:
    """A view that every backend can send: float8 as its bytes (gloo has no float8 type)."""
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t


def _holds(p2l: list[int], rank: int, per_rank: int, e: int) -> bool:
    return e in p2l[rank * per_rank : (rank + 1) * per_rank]
