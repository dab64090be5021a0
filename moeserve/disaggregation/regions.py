"""KVRegions: a rank's KV pool as registered byte regions, and slot lists turned into the byte
ranges one transfer writes (contiguous slots on both sides become one range per buffer)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVRegions:
    ptrs: list[int]  # base address of each buffer (per layer: K, V or the MLA latent)
    slot_bytes: list[int]  # bytes one slot occupies in it
    nbytes: list[int]

    @classmethod
    def of(cls, buffers: list[torch.Tensor]) -> KVRegions:
        """Buffers are [slots, ...] and contiguous: slot s starts at ptr + s * slot_bytes."""
        for b in buffers:
            if not b.is_contiguous():
                raise ValueError("KV buffers must be contiguous to be transferred")
        return cls([b.data_ptr() for b in buffers],
                   [b[0].numel() * b.element_size() for b in buffers],
                   [b.numel() * b.element_size() for b in buffers])

    def compatible(self, slot_bytes: list[int]) -> str | None:
        """None when a peer's buffers have the same layout, else why not."""
        if slot_bytes == self.slot_bytes:
            return None
        return (f"KV layouts differ: this rank has {len(self.slot_bytes)} buffers of "
                f"{sorted(set(self.slot_bytes))} bytes per slot, the peer {len(slot_bytes)} of "
                f"{sorted(set(slot_bytes))} (same model, dtype and spec settings needed)")

    def byte_ranges(self, src_slots: list[int], dst_ptrs: list[int], dst_slots: list[int]
                    ) -> tuple[list[int], list[int], list[int]]:
        """(src addresses, dst addresses, lengths) that copy src_slots[i] to dst_slots[i] in
        every buffer."""
        runs = slot_runs(src_slots, dst_slots)
        src, dst, lens = [], [], []
        for base, peer, width in zip(self.ptrs, dst_ptrs, self.slot_bytes):
            for s, d, n in runs:
                src.append(base + s * width)
                dst.append(peer + d * width)
                lens.append(n * width)
        return src, dst, lens


def slot_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """[(src start, dst start, count)]: maximal runs where both sides advance by one."""
    if len(src) != len(dst):
        raise ValueError(f"{len(src)} source slots for {len(dst)} destination slots")
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs
