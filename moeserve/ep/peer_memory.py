"""Symmetric peer memory: one buffer per rank that every rank of the group can write directly.

The `p2p` dispatcher moves tokens by writing straight into the destination rank's buffer, so the
gather and the transfer are one copy and no collective needs host-side split sizes. Two
implementations share one interface (`peer(rank)`, `barrier()`):

- CUDA: torch's symmetric memory (`torch.distributed._symmetric_memory`): the peers' allocations
  are mapped into this process, a copy into `peer(r)` travels over NVLink, and `barrier()` is a
  device-side barrier kernel on the current stream (release/acquire at system scope), so the host
  never waits. NVLink multicast is not used.
- CPU: one shared-memory file per rank (mmap), opened by every rank; `barrier()` is the gloo
  group's barrier. This runs the same dispatcher code in the CPU tests.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import uuid
from typing import Any

import torch
import torch.distributed as dist

ALIGN = 256  # bytes: every carved region starts aligned (vectorised copies, dtype views)


class PeerBuffers:
    """`nbytes` of symmetric memory on every rank of `group` (collective constructor)."""

    def __init__(self, nbytes: int, group: Any, device: torch.device):
        if device.type == "cuda":
            self._peers, self._barrier, self._keep = _cuda_symmetric(nbytes, group, device)
        else:
            self._peers, self._keep = _shared_files(nbytes, group)
            self._barrier = lambda: dist.barrier(group=group)

    def peer(self, rank: int) -> torch.Tensor:
        """Rank `rank`'s whole buffer as uint8 [nbytes], addressable from this rank."""
        return self._peers[rank]

    def barrier(self) -> None:
        """Every rank's earlier writes into any buffer are visible to every rank afterwards."""
        self._barrier()


class Layout:
    """Carves typed views at fixed offsets out of a flat uint8 buffer, the same on every rank."""

    def __init__(self):
        # name -> (byte offset, byte size, shape, dtype)
        self.regions: dict[str, tuple[int, int, tuple[int, ...], torch.dtype]] = {}
        self.nbytes = 0

    def add(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        size = torch.Size(shape).numel() * dtype.itemsize
        self.regions[name] = (self.nbytes, size, tuple(shape), dtype)
        self.nbytes += -(-size // ALIGN) * ALIGN

    def view(self, buf: torch.Tensor, name: str) -> torch.Tensor:
        offset, size, shape, dtype = self.regions[name]
        return buf[offset : offset + size].view(dtype).view(shape)


def _cuda_symmetric(nbytes: int, group: Any, device: torch.device):
    import torch.distributed._symmetric_memory as symm_mem

    buf = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
    buf.zero_()
    handle = symm_mem.rendezvous(buf, group)
    world = dist.get_world_size(group)
    peers = [handle.get_buffer(r, (nbytes,), torch.uint8) for r in range(world)]
    return peers, lambda: handle.barrier(channel=0), (buf, handle)


def _shared_files(nbytes: int, group: Any):
    """Each rank creates a zeroed file of nbytes and maps every rank's file; files are unlinked
    once all ranks have mapped them (the mappings stay valid), so nothing is left behind."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    token = [uuid.uuid4().hex if rank == 0 else None]
    dist.broadcast_object_list(token, src=dist.get_global_rank(group, 0), group=group)
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    paths = [os.path.join(folder, f"moeserve-p2p-{token[0]}-{r}") for r in range(world)]
    with open(paths[rank], "wb") as f:
        f.truncate(nbytes)
    dist.barrier(group=group)
    maps = []
    for path in paths:
        with open(path, "r+b") as f:
            maps.append(mmap.mmap(f.fileno(), nbytes))
    dist.barrier(group=group)
    os.unlink(paths[rank])
    peers = [torch.frombuffer(m, dtype=torch.uint8, count=nbytes) for m in maps]
    return peers, tuple(maps)
