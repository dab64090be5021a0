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

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel():
            self._free = torch.cat([self._free, slots.detach().to("cpu", torch.int64)])
