"""TokenToKVPoolAllocator: hands out free KV slots (slot 0 is a reserved padding sink)."""

from __future__ import annotations

import torch


class TokenToKVPoolAllocator:
    """Free-list of KV slots 1..size; slot 0 is never handed out so padded writes can target it.

    `alloc` returns None without side effects when there is not enough room; the caller evicts from the
    prefix cache or retracts requests, then retries. Freeing a slot twice is a caller bug.
    """

    def __init__(self, size: int, device: torch.device | str = "cpu"):
        self.size = size
        self.device = device
        self.clear()

    def clear(self) -> None:
        self._free = torch.arange(1, self.size + 1, dtype=torch.int64)

    def available_size(self) -> int:
        return int(self._free.numel())

    def alloc(self, n: int) -> torch.Tensor | None:
        if n > self._free.numel():
            return None
        out, self._free = self._free[:n], self._free[n:]
        return out

    def alloc_contiguous(self, n: int) -> torch.Tensor | None:
        """n free slots as one run where one exists, else the n lowest (few runs): what a PD
        decode server asks for, so that the KV it receives lands in few byte ranges. Sorts the
        free list (O(free log free), once per PD request)."""
        if n > self._free.numel():
            return None
        free = torch.sort(self._free).values
        if n > 0:
            starts = torch.nonzero(free[n - 1:] - free[: free.numel() - n + 1] == n - 1)
            i = int(starts[0]) if starts.numel() else 0
        else:
            i = 0
        out = free[i: i + n]
        self._free = torch.cat([free[:i], free[i + n:]])
        return out

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel():
            self._free = torch.cat([self._free, slots.detach().to("cpu", torch.int64)])
