"""ReqToTokenPool: (request slot, position) → KV slot index."""

from __future__ import annotations

import torch

from moeserve.kvcache.pool import zeros


class ReqToTokenPool:
    """Two [max_reqs, max_context] device tables, one row per live request:
    `req_to_token` (position → KV slot) and `token_ids` (position → token id). The token table lets
    the next decode step read tokens the previous step sampled on the device, before the host knows
    them (overlap loop).

    Rows are handed out by `alloc` and returned by `free`; the contents of a freed row are stale and
    must not be read.
    """

    def __init__(self, size: int, max_context_len: int, device: torch.device | str,
                 scratch: int = 0):
        """`scratch`: rows past the `size` live ones, never handed out: a draft tree's nodes
        attend through them (spec_mtp/tree_decoder.py), each over its own ancestors."""
        self.size, self.scratch = size, scratch
        self.max_context_len = max_context_len
        rows = size + scratch
        self.req_to_token = zeros((rows, max_context_len), torch.int64, device)
        self.token_ids = zeros((rows, max_context_len + 1), torch.int64, device)
        self._free: list[int] = list(range(size))

    def available_size(self) -> int:
        return len(self._free)

    def alloc(self, n: int = 1) -> list[int] | None:
        """Take n rows, or None (nothing taken) when fewer are free."""
        if n > len(self._free):
            return None
        rows, self._free = self._free[:n], self._free[n:]
        return rows

    def free(self, row: int | list[int]) -> None:
        rows = [row] if isinstance(row, int) else row
        self._free.extend(rows)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        """Record that positions [start, start + len(slots)) of request `row` live in `slots`."""
        self.req_to_token[row, start : start + slots.numel()] = slots.to(self.req_to_token.device)
