"""CacheManager: KV slots of requests and the radix prefix cache, kept consistent.

Ownership of a request's KV row (req_to_token[req_pool_idx, :kv_len]):
| positions            | owner                                                          |
| [0, prefix_len)      | the prefix cache (locked through req.last_node)               |
| [prefix_len, kv_len) | the request; handed to the cache or freed when it finishes    |
"""

from __future__ import annotations

import torch

from moeserve.core import Req
from moeserve.kvcache.radix import NoRadixCache, RadixCache
from moeserve.runtime.kv_memory import KVMemory


class CacheManager:
    def __init__(self, memory: KVMemory, page_size: int = 1, disable_radix: bool = False):
        self.memory = memory
        free = memory.allocator.free
        self._deferred_rows: list[int] = []
        self.tree = NoRadixCache(page_size, free) if disable_radix else RadixCache(page_size, free)

    # ---- capacity ---------------------------------------------------------------------------
    def available(self) -> int:
        """Slots obtainable now: free plus evictable from the prefix cache."""
        return self.memory.allocator.available_size() + self.tree.evictable_size()

    def used_tokens(self) -> int:
        return self.memory.allocator.size - self.available()

    def alloc_slots(self, n: int, contiguous: bool = False,
                    after: int | None = None) -> torch.Tensor | None:
        """n free slots, evicting unlocked cache leaves if needed; None (no change) if impossible.
        `contiguous`: as few runs as the free list allows, preferring the one starting at `after`
        (PD: the KV a prefill sends or a decode receives; kvcache/allocator.py)."""
        short = n - self.memory.allocator.available_size()
        if short > 0:
            self.tree.evict(short)
        alloc = self.memory.allocator
        return alloc.alloc_contiguous(n, after) if contiguous else alloc.alloc(n)

    # ---- request lifecycle ------------------------------------------------------------------
    def match_prefix_len(self, req: Req) -> int:
        """Cached prefix length without locking (for longest-prefix-first ordering)."""
        return int(self.tree.match_prefix(self._key(req)).indices.numel())

    def admit(self, req: Req, row: int) -> int:
        """Give `req` a table row and lock its longest cached prefix (at least one token is left
        to compute so the next token's logits exist). → tokens the lock took out of the evictable
        pool: `available()` shrinks by that much, and an admission budget must be charged it."""
        match = self.tree.match_prefix(self._key(req))
        n = int(match.indices.numel())
        req.req_pool_idx, req.prefix_len, req.kv_len = row, n, n
        req.kv_slots = match.indices.tolist()
        req.last_node = match.last_node
        evictable = self.tree.evictable_size()
        self.tree.inc_lock_ref(match.last_node)
        locked = evictable - self.tree.evictable_size()
        if n:
            self.memory.req_to_token.req_to_token[row, :n] = match.indices.to(
                self.memory.req_to_token.req_to_token.device)
        return locked

    def release(self, req: Req, keep_row: bool = False) -> None:
        """The request is done (finished, aborted or retracted): hand its computed KV to the prefix
        cache, free the rest, unlock its prefix; its row is freed by `free_deferred_rows`.

        Slots may be freed while a step in flight still writes them: any step that reuses them is
        launched later and runs after it on the same worker."""
        tokens, slots = self._computed(req)
        aligned = self.tree.cacheable_len(len(tokens))
        shared = self.tree.insert(tokens[:aligned], slots[:aligned])
        self.memory.allocator.free(slots[req.prefix_len : shared])  # duplicates of cached tokens
        self.memory.allocator.free(slots[aligned:])
        self.tree.dec_lock_ref(req.last_node)
        req.last_node, req.prefix_len, req.kv_len, req.kv_slots = None, 0, 0, []
        if not keep_row:
            self._deferred_rows.append(req.req_pool_idx)
            req.req_pool_idx = None

    def free_deferred_rows(self) -> None:
        """Return released table rows once no step in flight can still write to them (a step
        writes its slot map and sampled token into its requests' rows when it runs)."""
        self.memory.req_to_token.free(self._deferred_rows)
        self._deferred_rows = []

    def cache_unfinished(self, req: Req, computed_len: int) -> None:
        """After a prefill chunk that computed KV up to `computed_len`: publish that prefix so
        others can share it, and move the request's lock to it. (With the overlap loop the next
        chunk may already be scheduled: its slots are not in the table yet and are left alone.)"""
        tokens, slots = self._computed(req, computed_len)
        aligned = self.tree.cacheable_len(len(tokens))
        if aligned <= req.prefix_len:
            return
        shared = self.tree.insert(tokens[:aligned], slots[:aligned])
        self.memory.allocator.free(slots[req.prefix_len : shared])
        match = self.tree.match_prefix(tokens[:aligned])
        table = self.memory.req_to_token.req_to_token
        table[req.req_pool_idx, :aligned] = match.indices.to(table.device)
        req.kv_slots[:aligned] = match.indices.tolist()
        self.tree.inc_lock_ref(match.last_node)
        self.tree.dec_lock_ref(req.last_node)
        req.last_node, req.prefix_len = match.last_node, aligned

    def flush(self) -> bool:
        """Drop the whole prefix cache; refused (False) while any prefix is locked."""
        if self.tree.protected_size() > 0:
            return False
        self.tree.evict(self.tree.evictable_size())
        return True

    # ---- helpers ----------------------------------------------------------------------------
    @staticmethod
    def _key(req: Req) -> list[int]:
        """What the prefix cache may serve: all but the last token (whose logits are needed), and
        no more than `req.max_cached_prefix` (prompt logprobs yet to compute). NOTE: capping the
        match recomputes those positions' KV into the request's own slots, the same compute as
        any way of getting their hidden states back (docs/prompt_logprobs.md measures it)."""
        key = req.fill_ids[:-1] if req.fill_ids else []
        cap = req.max_cached_prefix
        return key if cap is None else key[:cap]

    def _computed(self, req: Req, upto: int | None = None) -> tuple[list[int], torch.Tensor]:
        """(tokens whose ids are known, slots) for the first `upto` (default kv_len) positions.
        Slots come from the host copy: a step in flight may not have written its slots into the
        device table yet. With the overlap loop that step may also hold one slot for a token the
        host has not seen: it is freed, never cached (a later step reuses it only after the
        in-flight one has run)."""
        n = req.kv_len if upto is None else upto
        return req.fill_ids[:n], torch.tensor(req.kv_slots[:n], dtype=torch.int64)
