from __future__ import annotations

import random

import pytest
import torch

from moeserve.kvcache.radix import NoRadixCache, RadixCache


class FakeAllocator:
    """Hands out unique slots; asserts no double free and lets tests check for leaks."""

    def __init__(self, size: int = 4096):
        self.free_set = set(range(1, size))
        self.size = size

    def alloc(self, n: int) -> torch.Tensor:
        slots = sorted(self.free_set)[:n]
        assert len(slots) == n, "out of slots"
        self.free_set.difference_update(slots)
        return torch.tensor(slots, dtype=torch.int64)

    def free(self, slots: torch.Tensor) -> None:
        for s in slots.tolist():
            assert s not in self.free_set, f"double free of slot {s}"
            self.free_set.add(s)

    def all_free(self) -> bool:
        return len(self.free_set) == self.size - 1


def t(*xs: int) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


def test_split_on_partial_match():
    c = RadixCache()
    assert c.insert([1, 2, 3, 4], t(10, 11, 12, 13)) == 0
    m = c.match_prefix([1, 2, 9])
    assert m.indices.tolist() == [10, 11]
    assert m.last_node.key == [1, 2] and len(m.last_node.children) == 1
    (lower,) = m.last_node.children.values()
    assert lower.key == [3, 4] and lower.value.tolist() == [12, 13]
    assert m.last_node.parent.parent is None  # parent is the root
    assert c.total_size() == 4
    c.check_integrity()
    # a branch off the split point
    assert c.insert([1, 2, 7], t(20, 21, 22)) == 2
    assert len(m.last_node.children) == 2
    assert c.match_prefix([1, 2, 7, 8]).indices.tolist() == [10, 11, 22]
    assert c.match_prefix([5]).indices.numel() == 0
    c.check_integrity()


def test_insert_returns_shared_len():
    c = RadixCache()
    assert c.insert([1, 2, 3], t(1, 2, 3)) == 0
    assert c.insert([1, 2, 3, 4, 5], t(7, 8, 9, 4, 5)) == 3
    assert c.insert([1, 2], t(7, 8)) == 2
    assert c.insert([1, 2, 3, 4, 5], t(7, 8, 9, 10, 11)) == 5
    assert c.match_prefix([1, 2, 3, 4, 5]).indices.tolist() == [1, 2, 3, 4, 5]
    assert c.total_size() == 5
    c.check_integrity()


def test_extra_key_isolation():
    c = RadixCache()
    c.insert([1, 2, 3], t(1, 2, 3), extra_key="a")
    assert c.match_prefix([1, 2, 3]).indices.numel() == 0
    assert c.match_prefix([1, 2, 3], extra_key="b").indices.numel() == 0
    assert c.insert([1, 2, 3], t(4, 5, 6), extra_key="b") == 0
    assert c.match_prefix([1, 2, 3], extra_key="a").indices.tolist() == [1, 2, 3]
    assert c.match_prefix([1, 2, 3], extra_key="b").indices.tolist() == [4, 5, 6]
    assert c.total_size() == 6
    c.check_integrity()


def test_evict_lru_order_and_touch():
    freed: list[list[int]] = []
    c = RadixCache(free_slots=lambda s: freed.append(s.tolist()))
    c.insert([1, 1], t(1, 2))
    c.insert([2, 2], t(3, 4))
    c.insert([3, 3], t(5, 6))
    c.match_prefix([1, 1])  # touch: [1, 1] is now the most recent
    assert c.evict(0) == 0 and freed == []
    assert c.evict(3) == 4
    assert freed == [[3, 4], [5, 6]]
    assert c.match_prefix([1, 1]).indices.tolist() == [1, 2]
    c.check_integrity()


def test_evict_parent_becomes_candidate():
    freed: list[list[int]] = []
    c = RadixCache(free_slots=lambda s: freed.append(s.tolist()))
    c.insert([1, 2, 3], t(1, 2, 3))
    c.insert([1, 2, 4], t(1, 2, 4))  # split: [1, 2] -> {[3], [4]}
    c.insert([9], t(9))
    assert c.evict(100) == 5
    assert sorted(freed) == [[1, 2], [3], [4], [9]]
    assert freed.index([1, 2]) > max(freed.index([3]), freed.index([4]))
    assert c.total_size() == 0 and c.evictable_size() == 0
    c.check_integrity()


def test_lock_protects_and_size_accounting():
    c = RadixCache()
    c.insert([1, 2, 3, 4], t(1, 2, 3, 4))
    c.insert([5, 6], t(5, 6))
    m = c.match_prefix([1, 2, 3])  # splits [1, 2, 3] | [4]
    c.inc_lock_ref(m.last_node)
    assert (c.evictable_size(), c.protected_size()) == (3, 3)
    c.inc_lock_ref(m.last_node)
    assert (c.evictable_size(), c.protected_size()) == (3, 3)
    assert c.evict(100) == 3  # [4] and [5, 6]
    assert (c.evictable_size(), c.protected_size()) == (0, 3)
    assert c.match_prefix([1, 2, 3]).indices.tolist() == [1, 2, 3]
    c.dec_lock_ref(m.last_node)
    assert c.evict(100) == 0
    c.dec_lock_ref(m.last_node)
    assert (c.evictable_size(), c.protected_size()) == (3, 0)
    c.check_integrity()
    assert c.evict(1) == 3
    assert c.total_size() == 0
    c.check_integrity()


def test_split_of_locked_node_keeps_handle():
    c = RadixCache()
    c.insert([1, 2, 3, 4], t(1, 2, 3, 4))
    m = c.match_prefix([1, 2, 3, 4])
    c.inc_lock_ref(m.last_node)
    c.match_prefix([1, 2])  # splits the locked node
    c.check_integrity()
    assert c.protected_size() == 4 and m.last_node.key == [3, 4]
    c.dec_lock_ref(m.last_node)
    assert (c.evictable_size(), c.protected_size()) == (4, 0)
    c.check_integrity()


def test_page_size():
    c = RadixCache(page_size=4)
    assert c.cacheable_len(10) == 8
    assert c.insert(list(range(10)), torch.arange(100, 110)) == 0
    assert c.total_size() == 8
    assert c.match_prefix(list(range(3))).indices.numel() == 0
    assert c.match_prefix(list(range(7))).indices.tolist() == list(range(100, 104))
    assert c.match_prefix(list(range(10))).indices.tolist() == list(range(100, 108))
    # divergence inside the second page matches only the first page
    m = c.match_prefix([0, 1, 2, 3, 4, 5, 99, 7])
    assert m.indices.tolist() == list(range(100, 104)) and len(m.last_node) == 4
    assert c.insert([0, 1, 2, 3, 4, 5, 99, 7], torch.arange(200, 208)) == 4
    c.check_integrity()
    for node in c._nodes():
        assert len(node) % 4 == 0


def test_no_radix_cache():
    c = NoRadixCache(page_size=4)
    assert c.insert([1, 2, 3, 4], t(1, 2, 3, 4)) == 0
    m = c.match_prefix([1, 2, 3, 4])
    assert m.indices.numel() == 0 and m.indices.dtype == torch.int64
    c.inc_lock_ref(m.last_node)
    c.dec_lock_ref(m.last_node)
    assert c.evict(10) == 0 and c.cacheable_len(7) == 0
    assert (c.total_size(), c.evictable_size(), c.protected_size()) == (0, 0, 0)
    c.check_integrity()


class FakeReq:
    """Mirrors what the scheduler keeps per request."""

    def __init__(self, cache, alloc: FakeAllocator, tokens: list[int], extra_key=None):
        self.cache, self.alloc, self.tokens, self.extra_key = cache, alloc, tokens, extra_key
        m = cache.match_prefix(tokens, extra_key)
        cache.inc_lock_ref(m.last_node)
        self.last_node, self.prefix_len = m.last_node, len(m.indices)
        self.slots = m.indices  # [filled] slots for tokens[:filled]

    def extend(self, n: int) -> None:
        new = self.alloc.alloc(min(n, len(self.tokens) - len(self.slots)))
        self.slots = torch.cat([self.slots, new])

    def _insert(self) -> int:
        filled = len(self.slots)
        aligned = self.cache.cacheable_len(filled)
        key = self.tokens[:aligned]
        shared = self.cache.insert(key, self.slots[:aligned], self.extra_key)
        self.alloc.free(self.slots[self.prefix_len : shared])  # duplicates of tree slots
        return aligned

    def cache_unfinished(self) -> None:
        aligned = self._insert()
        m = self.cache.match_prefix(self.tokens[:aligned], self.extra_key)
        assert len(m.indices) == aligned
        self.slots = torch.cat([m.indices, self.slots[aligned:]])
        self.cache.inc_lock_ref(m.last_node)
        self.cache.dec_lock_ref(self.last_node)
        self.last_node, self.prefix_len = m.last_node, aligned

    def cache_finished(self) -> None:
        aligned = self._insert()
        self.alloc.free(self.slots[aligned:])
        self.cache.dec_lock_ref(self.last_node)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("disabled", [False, True])
def test_chunked_request_simulation(page_size: int, disabled: bool):
    alloc = FakeAllocator(1000)
    cache = (NoRadixCache if disabled else RadixCache)(page_size, alloc.free)
    system = list(range(1, 14))
    prompts = [system + [100 + i] * (5 + 3 * i) for i in range(3)] + [system[:6], system]
    reqs = [FakeReq(cache, alloc, p, "ns" if i == 4 else None) for i, p in enumerate(prompts)]
    # interleave chunked prefills (chunk 5 tokens) so requests race to insert the shared prefix
    while any(len(r.slots) < len(r.tokens) for r in reqs):
        for r in reqs:
            if len(r.slots) < len(r.tokens):
                r.extend(5)
                r.cache_unfinished()
                cache.check_integrity()
    for r in reqs:
        r.cache_finished()
        cache.check_integrity()
    assert cache.protected_size() == 0
    if not disabled:
        assert cache.match_prefix(system).indices.numel() == cache.cacheable_len(len(system))
    cache.evict(cache.evictable_size())
    assert cache.total_size() == 0 and alloc.all_free()


def _model_match(model: dict, key: list[int], extra_key, page: int) -> list[int]:
    out: list[int] = []
    for end in range(page, len(key) + 1, page):
        slots = model.get((extra_key, tuple(key[:end])))
        if slots is None:
            break
        out.extend(slots)
    return out


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("seed", range(6))
def test_randomized_against_model(page_size: int, seed: int):
    rng = random.Random(seed)
    alloc = FakeAllocator()
    # NOTE: pages never share a node across a divergence, so the model works in whole pages.
    model: dict[tuple, tuple] = {}  # (extra_key, page-aligned prefix) -> its last page's slots
    slot_to_prefix: dict[int, tuple] = {}
    locked: list[tuple] = []  # (node, slots it protects)

    def on_free(slots: torch.Tensor) -> None:
        protected = {s for _, ss in locked for s in ss}
        for s in slots.tolist():
            assert s not in protected, "evicted a locked slot"
            model.pop(slot_to_prefix.pop(s), None)
        alloc.free(slots)

    cache = RadixCache(page_size, on_free)

    def rand_key() -> list[int]:
        return [rng.randint(0, 2) for _ in range(rng.randint(0, 14))]

    for _ in range(1000):
        op, ek = rng.random(), rng.choice([None, None, "x"])
        key = rand_key()
        if op < 0.4:
            slots = alloc.alloc(len(key))
            expect = len(_model_match(model, key, ek, page_size))
            shared = cache.insert(key, slots, ek)
            assert shared == expect
            aligned = cache.cacheable_len(len(key))
            for end in range(shared + page_size, aligned + 1, page_size):
                prefix = (ek, tuple(key[:end]))
                model[prefix] = tuple(slots[end - page_size : end].tolist())
                slot_to_prefix.update((s, prefix) for s in model[prefix])
            alloc.free(torch.cat([slots[:shared], slots[aligned:]]))
        elif op < 0.7:
            m = cache.match_prefix(key, ek)
            assert m.indices.tolist() == _model_match(model, key, ek, page_size)
            if rng.random() < 0.5:
                cache.inc_lock_ref(m.last_node)
                locked.append((m.last_node, m.indices.tolist()))
        elif op < 0.85 and locked:
            node, _ = locked.pop(rng.randrange(len(locked)))
            cache.dec_lock_ref(node)
        else:
            before = cache.evictable_size()
            n = rng.randint(0, 12)
            got = cache.evict(n)
            assert got >= min(n, before) and cache.evictable_size() == before - got
        cache.check_integrity()
        assert cache.total_size() == len(model) * page_size == len(slot_to_prefix)
        assert cache.evictable_size() + cache.protected_size() == cache.total_size()

    for node, _ in locked:
        cache.dec_lock_ref(node)
    locked.clear()
    assert cache.protected_size() == 0
    cache.evict(cache.evictable_size())
    assert cache.total_size() == 0 and not model and alloc.all_free()
