"""The process groups of one membership generation: gloo, with bounded collective timeouts.

Why gloo and not Mooncake's fault-tolerant backend: the `mooncake-transfer-engine-non-cuda`
wheel ships no `mooncake.pg` build (its pg.py imports `mooncake.pg_2_13_0`, absent, and raises
ImportError), so on CPU the group is gloo: a collective with a dead peer fails at once when
that peer was its direct partner ("Connection closed by peer") and otherwise after the group's
timeout, which elastic EP sets to `parallel.elastic_timeout_s` once serving. A failed group is
not repaired: every survivor destroys it and joins the next generation's, which meets under its
own store prefix (docs/elastic_ep.md has the measurements).
"""

from __future__ import annotations

import datetime
import logging

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, TCPStore
from torch.distributed.distributed_c10d import _set_pg_timeout

from moeserve.distributed import ParallelMesh
from moeserve.elastic.membership import Membership

logger = logging.getLogger(__name__)


def is_comm_failure(e: BaseException) -> bool:
    """A collective that failed because a peer is gone or late (not a bug in the step)."""
    text = str(e)
    return isinstance(e, getattr(dist, "DistError", ())) or any(s in text for s in (
        "Connection closed", "Connection reset", "Timed out", "timed out", "Broken pipe",
        "Application timeout",  # gloo: a pair closed by another op's timeout (async a2a wait)
        "gloo", "Socket", "NCCL"))


def form_group(mesh: ParallelMesh, store: TCPStore, m: Membership, rank: int,
               timeout_s: float) -> None:
    """Join generation `m` as global `rank` (collective over m's members) and point `mesh` (in
    place: the scheduler, runner and dispatchers share it) at the new groups."""
    leave_group()
    n, me = len(m.ranks), m.index(rank)
    timeout = datetime.timedelta(seconds=timeout_s)
    # NOTE (GPUs, untested here): the EP group is NCCL; a dead peer then surfaces only through
    # NCCL's watchdog timeout (TORCH_NCCL_ASYNC_ERROR_HANDLING=2 raises instead of tearing down)
    backend = "nccl" if mesh.device.type == "cuda" else "gloo"
    if mesh.device.type == "cuda":
        torch.cuda.set_device(mesh.device)
    dist.init_process_group(backend, store=PrefixStore(f"g{m.generation}", store), rank=me,
                            world_size=n, timeout=timeout)
    world = dist.group.WORLD
    cpu = dist.new_group(backend="gloo", timeout=timeout)  # the DP sync's own (distributed.py)
    mesh.rank, mesh.world_size, mesh.dp_size = me, n, n
    mesh.ep_rank, mesh.ep_size = me, n
    mesh.world_group, mesh.cpu_group, mesh.ep_group = world, cpu, world


def set_timeout(mesh: ParallelMesh, timeout_s: float) -> None:
    """Every collective of the mesh's groups fails after `timeout_s` without its peers."""
    timeout = datetime.timedelta(seconds=timeout_s)
    for group in {id(g): g for g in (mesh.world_group, mesh.cpu_group) if g is not None}.values():
        _set_pg_timeout(timeout, group)


def leave_group() -> None:
    """Destroy this process's groups (peers may be dead: nothing is waited for)."""
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as e:  # a broken group may refuse an orderly teardown
            logger.warning("leaving the old process group: %s", e)
