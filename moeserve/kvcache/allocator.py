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

    def alloc_contiguous(self, n: int, after: int | None = None) -> torch.Tensor | None:
        """n free slots in as few runs of consecutive slots as the free list allows: what both PD
        roles ask for, since a transfer engine pays per byte range (docs/disaggregation.md).

        The FIFO free list never coalesces (frees append in eviction order, so a plain `alloc`
        hands out ever shorter pieces); this reads the runs off a free-slot mask instead (linear
        in the pool, no sort). One run when one is long enough: the one starting at `after`
        (a chunked prompt's next chunk continues its last one), else the shortest that fits (long
        runs stay for long prompts); otherwise the longest runs first (lowest slots on ties)."""
        if n > self._free.numel():
            return None
        if n <= 0:
            return self._free[:0]
        mask = torch.zeros(self.size + 2, dtype=torch.int8)
        mask[self._free] = 1
        edges = torch.diff(mask)
        starts = torch.nonzero(edges == 1).flatten() + 1
        lens = torch.nonzero(edges == -1).flatten() + 1 - starts
        fits = lens >= n
        if after is not None and bool((fits & (starts == after)).any()):
            out = torch.arange(after, after + n, dtype=torch.int64)
        elif bool(fits.any()):
            i = int(torch.argmin(lens.masked_fill(~fits, self.size + 1)))
            out = torch.arange(int(starts[i]), int(starts[i]) + n, dtype=torch.int64)
        else:
            order = torch.sort(lens, descending=True, stable=True).indices
            k = int(torch.searchsorted(torch.cumsum(lens[order], 0), n)) + 1
            chosen = torch.sort(order[:k]).values  # ascending slots
            out = torch.cat([torch.arange(int(s), int(s) + int(m)) for s, m in
                             zip(starts[chosen], lens[chosen])])[:n]
        taken = torch.zeros(self.size + 2, dtype=torch.bool)
        taken[out] = True
        self._free = self._free[~taken[self._free]]
        return out

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel():
            self._free = torch.cat([self._free, slots.detach().to("cpu", torch.int64)])
