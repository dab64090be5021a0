"""Rank paths of the target's tokens under a draft head, and the pruned trees they choose.

The eval (train_eval.evaluate) ranks, at every chain start p and step k, the target's token among
the head's candidates along the right path (`label_ranks`). A start whose tokens ranked
(r_1, r_2, ..) is accepted to depth d by any tree that holds the node (r_1, .., r_d), so counting
these prefixes over the held-out answers scores every node of every tree at once
(`rank_path_counts`); the M most counted are the pruned tree of M nodes that serving builds
(TreeShape.best) from the counts the trainer writes into the head's config.json (`tree_paths`).

The accept lengths reported for pruned trees are cross-fitted: the tree walked over one half of
the answers is chosen from the other half's counts, so the figure is not flattered by choosing
and scoring on the same answers.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable

from moeserve.spec_mtp.tree import TreeShape

Path = tuple[int, ...]


class Answer:
    """One held-out answer's label ranks: ranks[k][j] = rank of the step-(k+1) label at position
    j; chain starts run from `start`, labels exist below `n_labels`."""

    def __init__(self, start: int, n_labels: int, ranks: list[list[int]]):
        self.start, self.n_labels, self.ranks = start, n_labels, ranks

    def path(self, p: int, max_rank: int) -> Path:
        """The rank path of the chain starting at p, cut at the first rank >= max_rank or
        missing label."""
        out: list[int] = []
        for k, row in enumerate(self.ranks):
            if p + k >= self.n_labels or row[p + k] >= max_rank:
                break
            out.append(row[p + k])
        return tuple(out)


def rank_path_counts(answers: list[Answer], max_rank: int) -> Counter:
    """How many chain starts' rank paths begin with each path (every prefix of every start's
    path counted once)."""
    counts: Counter = Counter()
    for a in answers:
        for p in range(a.start, a.n_labels):
            path = a.path(p, max_rank)
            for d in range(1, len(path) + 1):
                counts[path[:d]] += 1
    return counts


def walk(accepts_at: Callable[[int], int], start: int, n_labels: int) -> tuple[int, int]:
    """(tokens, verify steps) of speculation over one answer as served: prefill emitted the first
    answer token, so the first round starts at `start`; a round at p accepts `accepts_at(p)`
    drafts, emits them and the target's token, and the next round starts one position before the
    last emitted token. The last round emits only the tokens the answer has left."""
    p, tokens, verify = start, 0, 0
    while p < n_labels:
        emitted = min(accepts_at(p) + 1, n_labels - p)
        tokens, verify, p = tokens + emitted, verify + 1, p + emitted
    return tokens, verify


def tree_walk(answer: Answer, shape: TreeShape) -> tuple[int, int]:
    """`walk` with a tree: a round at p accepts the longest prefix of p's rank path that is a
    node of `shape`."""

    def accepts_at(p: int) -> int:
        path = answer.path(p, shape.topk)
        d = 0
        while d < len(path) and path[: d + 1] in shape.index:
            d += 1
        return d

    return walk(accepts_at, answer.start, answer.n_labels)


def pruned_tree_accept(answers: list[Answer], topk: int, depth: int,
                       nodes: tuple[int, ...]) -> dict[int, float]:
    """Per node budget M: the served accept length of the best M-node tree (ranks < topk, depth
    <= depth), cross-fitted over two halves of `answers`."""
    halves = answers[0::2], answers[1::2]
    counts = [rank_path_counts(h, topk) for h in halves]
    out = {}
    for m in nodes:
        tokens = verify = 0
        for i, half in enumerate(halves):
            shape = TreeShape.best(topk, depth, m, counts[1 - i])
            for a in half:
                t, v = tree_walk(a, shape)
                tokens, verify = tokens + t, verify + v
        out[m] = tokens / verify if verify else 1.0
    return out


def paths_to_json(counts: Counter, limit: int = 256) -> list[list]:
    """The most counted paths as [[r_1, .., r_d], count] rows (config.json's `tree_paths`)."""
    rows = sorted(counts.items(), key=lambda kv: (-kv[1], len(kv[0]), kv[0]))[:limit]
    return [[list(p), int(c)] for p, c in rows]


def paths_from_json(rows: list[list] | None) -> dict[Path, float] | None:
    if not rows:
        return None
    return {tuple(int(r) for r in p): float(c) for p, c in rows}
