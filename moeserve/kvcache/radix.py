"""Radix prefix cache: token ids -> KV slot indices, with lock refs and LRU eviction.

Pure data structure (only torch). The scheduler owns the allocator; this tree owns the slots it
stores and hands them back through ``free_slots`` when it evicts them.

Scheduler usage (all lengths in tokens; ``slots`` is the request's row of slots, ``prefix_len``
the length the request got from ``match_prefix``, ``last_node`` the node it locked):

    aligned = cache.cacheable_len(len(tokens))
    shared = cache.insert(tokens[:aligned], slots[:aligned])
    free(slots[prefix_len:shared])          # duplicates: the tree already held these tokens
    finished:   free(slots[aligned:]); cache.dec_lock_ref(last_node)
    unfinished: m = cache.match_prefix(tokens[:aligned])
                slots[:aligned] = m.indices # canonical slots; slots[aligned:] stay with the request
                cache.inc_lock_ref(m.last_node); cache.dec_lock_ref(last_node)
                prefix_len, last_node = aligned, m.last_node

The same code is correct for ``NoRadixCache`` (cacheable_len is 0, so everything is freed).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

FreeFn = Callable[[torch.Tensor], None]
ChildKey = tuple  # (extra_key, first page of token ids)

_EMPTY = torch.empty(0, dtype=torch.int64)


class TreeNode:
    """One edge of the tree: a run of tokens and their KV slots.

    ``lock_ref`` counts the locked requests whose path passes through this node; a node with
    ``lock_ref > 0`` is protected and never evicted. ``last_access`` is a logical clock tick.
    """

    _next_id = 0

    def __init__(self, key: list[int], value: torch.Tensor, extra_key: str | None = None):
        self.key = key  # token ids, len == len(value)
        self.value = value  # [len(key)] int64 slot indices
        self.extra_key = extra_key
        self.parent: TreeNode | None = None
        self.children: dict[ChildKey, TreeNode] = {}
        self.lock_ref = 0
        self.last_access = 0
        self.id = TreeNode._next_id
        TreeNode._next_id += 1

    def __len__(self) -> int:
        return len(self.key)

    def is_leaf(self) -> bool:
        return not self.children

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, len={len(self)}, lock={self.lock_ref})"


class MatchResult(NamedTuple):
    indices: torch.Tensor  # [matched_len] int64 slots, owned by the tree
    last_node: TreeNode  # node ending exactly at matched_len (the root if nothing matched)


class RadixCache:
    """Prefix tree over token ids (namespaced by ``extra_key``) whose values are KV slots.

    Invariants: every non-root node has a non-empty key whose length is a multiple of
    ``page_size``; ``evictable_size() + protected_size() == total_size()``; a node's lock_ref is
    at least each child's lock_ref. The root is always locked and holds nothing.
    """

    def __init__(self, page_size: int = 1, free_slots: FreeFn | None = None):
        assert page_size >= 1
        self.page_size = page_size
        self.free_slots: FreeFn = free_slots or (lambda slots: None)
        self.reset()

    # ---- queries -------------------------------------------------------------------------

    def cacheable_len(self, n: int) -> int:
        """Length of an ``n``-token sequence that ``insert`` would store (page-aligned)."""
        return n - n % self.page_size

    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def total_size(self) -> int:
        """Tokens stored in the tree (full recount)."""
        return sum(len(n) for n in self._nodes())

    # ---- match / insert ------------------------------------------------------------------

    def match_prefix(self, key: Sequence[int], extra_key: str | None = None) -> MatchResult:
        """Longest cached page-aligned prefix of ``key`` (token ids as Python ints).

        Mutates: splits the node where the match ends inside it (so ``last_node`` ends exactly at
        the matched length) and refreshes ``last_access`` along the path. Lock ``last_node``
        before anything may call ``evict`` if the returned indices are going to be used.
        """
        key = list(key[: self.cacheable_len(len(key))])
        node, values = self._root, []
        tick = self._tick()
        while key:
            child = node.children.get(self._child_key(key, extra_key))
            if child is None:
                break
            n = self._match_len(child.key, key)
            if n < len(child):
                child = self._split(child, n)
            child.last_access = tick
            values.append(child.value)
            node, key = child, key[n:]
        indices = torch.cat(values) if values else _EMPTY.clone()
        return MatchResult(indices, node)

    def insert(self, key: Sequence[int], value: torch.Tensor, extra_key: str | None = None) -> int:
        """Store ``key -> value`` (page-aligned part only); return the length already present.

        ``value`` is [len(key)] int64 slots. The tree copies and takes ownership of
        ``value[shared:cacheable_len(len(key))]``; the caller still owns (and should free)
        ``value[:shared]`` duplicates beyond what it got from ``match_prefix`` and the unaligned
        tail. Mutates: may split one node, adds at most one leaf, refreshes ``last_access``.
        """
        assert len(value) == len(key), (len(value), len(key))
        aligned = self.cacheable_len(len(key))
        key, value = list(key[:aligned]), value[:aligned]
        node, shared, tick = self._root, 0, self._tick()
        while key:
            child = node.children.get(self._child_key(key, extra_key))
            if child is None:
                self._add_leaf(node, key, value, extra_key, tick)
                break
            n = self._match_len(child.key, key)
            if n < len(child):
                child = self._split(child, n)
            child.last_access = tick
            shared += n
            node, key, value = child, key[n:], value[n:]
        return shared

    # ---- locks ---------------------------------------------------------------------------

    def inc_lock_ref(self, node: TreeNode) -> None:
        """Protect ``node`` and its ancestors from eviction (moves their tokens to protected)."""
        while node is not self._root:
            if node.lock_ref == 0:
                self._evictable -= len(node)
                self._protected += len(node)
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]

    def dec_lock_ref(self, node: TreeNode) -> None:
        """Undo one ``inc_lock_ref(node)``; nodes reaching lock_ref 0 become evictable."""
        while node is not self._root:
            assert node.lock_ref > 0, f"unbalanced dec_lock_ref on {node}"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._protected -= len(node)
                self._evictable += len(node)
            node = node.parent  # type: ignore[assignment]

    # ---- eviction ------------------------------------------------------------------------

    def evict(self, num_tokens: int) -> int:
        """Evict unlocked leaves, least recently used first, until ``num_tokens`` are freed.

        Calls ``free_slots`` on each evicted node's value; a parent left childless and unlocked
        becomes a candidate. Returns tokens evicted (may exceed ``num_tokens`` by less than one
        node, or fall short if nothing evictable is left). Evicting 0 is a no-op.
        """
        if num_tokens <= 0:
            return 0
        heap = [(n.last_access, n.id, n) for n in self._nodes() if self._evictable_leaf(n)]
        heapq.heapify(heap)
        evicted = 0
        while heap and evicted < num_tokens:
            _, _, node = heapq.heappop(heap)
            evicted += self._delete_leaf(node)
            parent = node.parent
            if self._evictable_leaf(parent):
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        return evicted

    def reset(self) -> None:
        """Drop every node WITHOUT calling ``free_slots`` (the allocator is reset alongside)."""
        self._root = TreeNode([], _EMPTY.clone())
        self._root.lock_ref = 1
        self._evictable = 0
        self._protected = 0
        self._clock = 0

    # ---- debug ---------------------------------------------------------------------------

    def pretty_print(self) -> str:
        """Return (and print) an indented dump of the tree."""
        lines: list[str] = []

        def walk(node: TreeNode, depth: int) -> None:
            for child in node.children.values():
                head = str(child.key[:8])[:-1] + (", ...]" if len(child) > 8 else "]")
                ns = "" if child.extra_key is None else f" ns={child.extra_key}"
                lines.append(f"{'  ' * depth}{head} len={len(child)} lock={child.lock_ref}{ns}")
                walk(child, depth + 1)

        walk(self._root, 0)
        lines.append(f"total={self.total_size()} evictable={self._evictable} "
                     f"protected={self._protected}")
        text = "\n".join(lines)
        print(text)
        return text

    def check_integrity(self) -> None:
        """Assert the structural invariants and that the size counters match a recount."""
        evictable = protected = 0
        for node in self._nodes():
            assert len(node) > 0 and len(node) % self.page_size == 0, node
            assert node.value.dtype == torch.int64 and node.value.shape == (len(node),), node
            assert node.parent is not None and node.lock_ref >= 0
            assert node.parent.children.get(self._child_key(node.key, node.extra_key)) is node
            assert node.parent is self._root or node.parent.lock_ref >= node.lock_ref, node
            if node.lock_ref > 0:
                protected += len(node)
            else:
                evictable += len(node)
        assert (evictable, protected) == (self._evictable, self._protected), (
            evictable, protected, self._evictable, self._protected)

    # ---- internals -----------------------------------------------------------------------

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _child_key(self, key: Sequence[int], extra_key: str | None) -> ChildKey:
        return (extra_key, tuple(key[: self.page_size]))

    def _match_len(self, a: Sequence[int], b: Sequence[int]) -> int:
        """Common prefix length of ``a`` and ``b``, rounded down to whole pages."""
        n = 0
        for x, y in zip(a, b):
            if x != y:
                break
            n += 1
        return self.cacheable_len(n)

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut ``child`` after ``n`` tokens; return the new upper node (``child`` keeps the rest).

        NOTE: ``child`` stays the deeper node so handles held by requests keep their meaning.
        The upper node inherits lock_ref and last_access, so sizes are unchanged.
        """
        parent = child.parent
        assert parent is not None and 0 < n < len(child)
        upper = TreeNode(child.key[:n], child.value[:n], child.extra_key)
        upper.parent, upper.lock_ref, upper.last_access = parent, child.lock_ref, child.last_access
        parent.children[self._child_key(upper.key, upper.extra_key)] = upper
        child.key, child.value = child.key[n:], child.value[n:]
        child.parent = upper
        upper.children[self._child_key(child.key, child.extra_key)] = child
        return upper

    def _add_leaf(self, parent: TreeNode, key: list[int], value: torch.Tensor,
                  extra_key: str | None, tick: int) -> None:
        leaf = TreeNode(key, value.to(torch.int64).clone(), extra_key)
        leaf.parent, leaf.last_access = parent, tick
        parent.children[self._child_key(key, extra_key)] = leaf
        self._evictable += len(leaf)

    def _evictable_leaf(self, node: TreeNode) -> bool:
        return node is not self._root and node.is_leaf() and node.lock_ref == 0

    def _delete_leaf(self, node: TreeNode) -> int:
        assert self._evictable_leaf(node) and node.parent is not None
        self.free_slots(node.value)
        del node.parent.children[self._child_key(node.key, node.extra_key)]
        self._evictable -= len(node)
        return len(node)

    def _nodes(self) -> list[TreeNode]:
        """All non-root nodes (pre-order)."""
        out, stack = [], list(self._root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out


class NoRadixCache:
    """Prefix caching disabled: same interface, stores nothing, every call is a no-op."""

    def __init__(self, page_size: int = 1, free_slots: FreeFn | None = None):
        self.page_size = page_size
        self._root = TreeNode([], _EMPTY.clone())
        self._root.lock_ref = 1

    def cacheable_len(self, n: int) -> int:
        return 0

    def match_prefix(self, key: Sequence[int], extra_key: str | None = None) -> MatchResult:
        return MatchResult(_EMPTY.clone(), self._root)

    def insert(self, key: Sequence[int], value: torch.Tensor, extra_key: str | None = None) -> int:
        return 0

    def inc_lock_ref(self, node: TreeNode) -> None:
        assert node is self._root

    def dec_lock_ref(self, node: TreeNode) -> None:
        assert node is self._root

    def evict(self, num_tokens: int) -> int:
        return 0

    def reset(self) -> None:
        pass

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def total_size(self) -> int:
        return 0

    def pretty_print(self) -> str:
        print("<radix cache disabled>")
        return "<radix cache disabled>"

    def check_integrity(self) -> None:
        pass
