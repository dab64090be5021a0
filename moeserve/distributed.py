"""Process groups for one rank, built once and passed explicitly (never module globals).

| group      | members                               | used for                                  |
| world      | all tp_size ranks                     | EP dispatch/combine (ep_size = tp_size)   |
| cpu        | all ranks, gloo                       | the per-step DP sync (small int vectors)  |
| attn_tp    | tp_size / dp_size ranks of a DP group | attention TP (size 1 for now)             |
gloo on CPU, NCCL on CUDA; the rendezvous is tcp://parallel.dist_init_addr.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from moeserve.config import ParallelConfig


@dataclass
class ParallelMesh:
    rank: int
    world_size: int
    dp_rank: int
    dp_size: int
    ep_rank: int
    ep_size: int
    device: torch.device
    world_group: Any = None  # None when world_size == 1
    cpu_group: Any = None
    ep_group: Any = None

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def single_rank_mesh(device: torch.device) -> ParallelMesh:
    return ParallelMesh(rank=0, world_size=1, dp_rank=0, dp_size=1, ep_rank=0, ep_size=1,
                        device=device)


def init_mesh(p: ParallelConfig, rank: int, device: torch.device,
              timeout_s: float = 600.0) -> ParallelMesh:
    """Join the rendezvous as `rank` and build every group (collective: all ranks call it)."""
    if p.world_size == 1:
        return single_rank_mesh(device)
    if p.dist_init_addr is None:
        raise ValueError("parallel.dist_init_addr must be set when tp_size > 1")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://{p.dist_init_addr}", rank=rank,
                            world_size=p.world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    world = dist.group.WORLD
    # NOTE: its own group even on gloo: the DP sync (main thread) overlaps the previous step's
    # EP collectives (worker thread); two threads on one gloo group interleave differently per rank.
    cpu = dist.new_group(backend="gloo")
    ep_size = p.ep
    ep_group = world if ep_size == p.world_size else None
    dp_rank = rank // p.attn_tp_size
    return ParallelMesh(rank=rank, world_size=p.world_size, dp_rank=dp_rank, dp_size=p.dp_size,
                        ep_rank=rank if ep_size > 1 else 0, ep_size=ep_size, device=device,
                        world_group=world, cpu_group=cpu, ep_group=ep_group)


def destroy_mesh(mesh: ParallelMesh) -> None:
    """Leave every group before interpreter exit (collective: all ranks call it after their
    last collective). This rank's device work is waited for, then the ranks meet on the gloo
    group, so none destroys a communicator a peer still runs a collective on. Left alive, an
    NCCL communicator's watchdog thread outlives CUDA at exit and prints a c10::Error."""
    if not mesh.distributed or not dist.is_initialized():
        return
    if mesh.device.type == "cuda":
        torch.cuda.synchronize(mesh.device)
    dist.barrier(group=mesh.cpu_group)
    dist.destroy_process_group()
