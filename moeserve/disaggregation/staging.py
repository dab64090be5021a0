"""GatherStage: a registered buffer the prefill packs a fragmented prompt's KV into before writing.

A transfer engine pays per byte range (over TCP each is a request of its own). The prefill now
allocates few runs (kvcache/allocator.py: alloc_contiguous), so this stage is for what remains
fragmented: gathered first, each buffer's part of a chunk is one range per run of destination
slots. Off by default: on a CPU host the link is itself a memory copy (loopback TCP), so gathering
adds a copy as costly as the transfer (docs/disaggregation.md has the figures); on a GPU the
gather runs at HBM speed against a network link. NOTE: on CPU the block copies are `memmove`s,
not `Tensor.copy_`: the link thread's copy_ used torch's intra-op pool, which the scheduler's
forward and other processes keep busy, and ran at 0.1-0.4 GB/s against memmove's 2-5 GB/s.
"""

from __future__ import annotations

import ctypes
import itertools

import torch

from moeserve.disaggregation.transfer import KVTransfer


class GatherStage:
    def __init__(self, buffers: list[torch.Tensor], transfer: KVTransfer, nbytes: int):
        self.rows = [b.view(b.shape[0], -1).view(torch.uint8) for b in buffers]  # [slots, bytes]
        self.widths = [r.shape[1] for r in self.rows]
        per_token = sum(self.widths)
        self.capacity = max(1, nbytes // per_token)  # tokens per chunk
        self.buf = torch.empty(self.capacity * per_token, dtype=torch.uint8,
                               device=buffers[0].device)
        transfer.register(self.buf.data_ptr(), self.buf.numel())

    def write(self, transfer: KVTransfer, peer: str, src_slots: list[int], dst_ptrs: list[int],
              dst_slots: list[int]) -> int:
        """Copy src_slots[i] of every local buffer into the peer's dst_slots[i], a chunk of
        `capacity` tokens at a time (gather, then one write). → bytes written."""
        total, base = 0, self.buf.data_ptr()
        for a in range(0, len(src_slots), self.capacity):
            chunk = src_slots[a: a + self.capacity]
            k, runs, src_runs = len(chunk), dst_runs(dst_slots[a: a + self.capacity]), None
            if len(dst_runs(chunk)) * 4 <= k:  # runs of 4+ slots: block copies (memcpy)
                src_runs = dst_runs(chunk)
            else:
                idx = torch.tensor(chunk, dtype=torch.int64, device=self.buf.device)
            src, dst, lens, off = [], [], [], 0
            for rows, w, peer_ptr in zip(self.rows, self.widths, dst_ptrs):
                out = self.buf[off: off + k * w].view(k, w)
                if src_runs is None:  # NOTE: index_select of uint8 rows runs ~15x below memcpy
                    torch.index_select(rows, 0, idx, out=out)
                elif self.buf.is_cuda:
                    for i, s, n in src_runs:
                        out[i: i + n].copy_(rows[s: s + n])
                else:  # NOTE: copy_ from this thread ran 10-40x below memmove (see module doc)
                    dst0, src0 = out.data_ptr(), rows.data_ptr()
                    for i, s, n in src_runs:
                        ctypes.memmove(dst0 + i * w, src0 + s * w, n * w)
                for i, d, n in runs:
                    src.append(base + off + i * w)
                    dst.append(peer_ptr + d * w)
                    lens.append(n * w)
                off += k * w
            if self.buf.is_cuda:  # the engine reads the stage: the gather must have ended
                torch.cuda.current_stream(self.buf.device).synchronize()
            transfer.write(peer, src, dst, lens)
            total += sum(lens)
        return total


def dst_runs(dst: list[int]) -> list[tuple[int, int, int]]:
    """[(index in dst, first slot, count)]: maximal runs of consecutive destination slots."""
    runs: list[tuple[int, int, int]] = []
    for i, d in enumerate(dst):
        if runs and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((i, d, 1))
    return runs


def run_count(slots: list[int]) -> int:
    """How many runs of consecutive slots `slots` is."""
    return 1 + sum(1 for x, y in itertools.pairwise(slots) if y != x + 1) if slots else 0
