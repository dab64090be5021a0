"""Draft trees (spec.topk > 1): the shape, and which path of a verified tree the target accepts.

Node 0 is the request's last token x_L (the root); a node's children are distinct drafts after
it, the draft's top candidates in rank order. Two shapes (TreeShape):
- the full k-ary tree of depth N (spec.topk = k): k + k^2 + .. + k^N nodes, in heap order;
- a pruned tree (spec.num_draft_tokens = M + 1): the M rank paths most often right, as the
  trainer's eval counted them for a trained head (`tree_paths` in its config.json), else by a
  positional model. Static, as EAGLE-1's and Sequoia's trees: every round verifies the same
  shape, so verify cost is fixed and CUDA graphs capture it.
The target scores every node in one pass; the accepted path walks from the root into the child
whose token the target produces there, as long as one does.

Sampled requests use the multi-candidate form of the chain's rejection rule (accept.py): at each
node its children are one-hot drafts tried in turn; child c is accepted with probability r(c)
under the residual r (the target's processed distribution with the children tried so far zeroed
and the rest renormalised). If none is, the emitted token is drawn from r. Each emitted token is
then distributed as p itself: P(c_1) = p(c_1), P(c_2) = (1 - p(c_1)) p(c_2) / (1 - p(c_1)), and so
on, and the final draw covers the rest. When a leaf is accepted, a bonus token is drawn from its
p.
"""

from __future__ import annotations

import torch

from moeserve.config_schema import SpecConfig
from moeserve.core import SamplingParams
from moeserve.runtime.sampler import target_probs


# P(the target's token is the draft's rank-r candidate), the positional model that ranks a
# pruned tree's nodes when the draft has no measured rank paths (the MTP layer, a random head).
DEFAULT_RANK_ACCEPT = (0.6, 0.12, 0.05, 0.03, 0.02, 0.01, 0.01, 0.01)


class TreeShape:
    """A draft tree as its nodes' child-rank paths: node (r_1, .., r_d) is the draft's rank-r_d
    candidate after node (r_1, .., r_{d-1}). Nodes are numbered in breadth-first order (depth,
    then path), the root (the request's last token) 0; every level is contiguous, and a full
    k-ary tree comes out in heap order (the children of node i are k*i + 1 .. k*i + k)."""

    def __init__(self, topk: int, depth: int, paths: list[tuple[int, ...]] | None = None):
        if paths is None:  # the full k-ary tree
            paths = [()]
            for d in range(depth):
                paths += [p + (r,) for p in paths if len(p) == d for r in range(topk)]
            paths = paths[1:]
        paths = sorted({tuple(p) for p in paths}, key=lambda p: (len(p), p))
        index = {(): 0, **{p: i + 1 for i, p in enumerate(paths)}}
        self.index = index  # path → node
        for p in paths:
            if p[:-1] not in index or not 0 <= p[-1] < topk or len(p) > depth:
                raise ValueError(f"tree path {p}: its parent is missing, or a rank >= {topk}, "
                                 f"or deeper than {depth}")
        self.topk, self.paths = topk, paths
        self.depth = max((len(p) for p in paths), default=0)
        self._depths = [0] + [len(p) for p in paths]
        self.parent = [-1] + [index[p[:-1]] for p in paths]
        self.rank = [-1] + [p[-1] for p in paths]
        self._children: list[list[int]] = [[] for _ in range(len(paths) + 1)]
        for i in range(1, len(paths) + 1):
            self._children[self.parent[i]].append(i)

    @staticmethod
    def best(topk: int, depth: int, nodes: int,
             counts: dict[tuple[int, ...], float] | None = None) -> TreeShape:
        """The `nodes` most likely paths of ranks < topk and length <= depth: by `counts` (how
        often the target's tokens followed each rank path, measured by the trainer's eval), ties
        and unmeasured paths by DEFAULT_RANK_ACCEPT's product. A parent always scores above its
        children, so the chosen set is a tree."""
        prior = list(DEFAULT_RANK_ACCEPT) + [0.01] * topk
        scored, level = [], [((), 1.0)]
        for _ in range(depth):  # every candidate path with its prior (k^depth at most 4^8)
            level = [(p + (r,), s * prior[r]) for p, s in level for r in range(topk)]
            scored += level
        counts = counts or {}
        key = {p: (counts.get(p, 0.0), s) for p, s in scored}
        best = sorted(key, key=lambda p: (key[p][0], key[p][1], -len(p)), reverse=True)
        return TreeShape(topk, depth, best[:nodes])

    @property
    def nodes(self) -> int:
        """Draft nodes M (the root excluded)."""
        return len(self.paths)

    def level(self, d: int) -> range:
        """Indices of the nodes at depth d (0: the root)."""
        first = self._depths.index(d) if d in self._depths else len(self._depths)
        return range(first, first + self._depths.count(d))

    def depths(self) -> list[int]:
        """Depth of every node, root included ([M + 1])."""
        return list(self._depths)

    def children(self, node: int) -> list[int]:
        """The node's children, best draft rank first."""
        return self._children[node]

    def child_table(self) -> torch.Tensor:
        """[M + 1, topk] long: row i lists node i's children, -1 past them."""
        out = torch.full((self.nodes + 1, max(1, self.topk)), -1, dtype=torch.long)
        for i, kids in enumerate(self._children):
            out[i, : len(kids)] = torch.tensor(kids, dtype=torch.long)
        return out

    def ancestors(self) -> torch.Tensor:
        """[M + 1, N] long: column j - 1 is the node's ancestor at depth j (itself at its own
        depth), -1 past its depth."""
        out = torch.full((self.nodes + 1, self.depth), -1, dtype=torch.long)
        for i, d in enumerate(self._depths):
            node = i
            for j in range(d, 0, -1):
                out[i, j - 1] = node
                node = self.parent[node]
        return out


def greedy_tree_accept(shape: TreeShape, node_tokens: torch.Tensor,
                       target_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """node_tokens [B, M + 1] (drafts by node; the root's entry is unused), target_ids
    [B, M + 1] (the target's argmax at every node) → (path [B, N]: index of the accepted node at
    each depth, 0 past the accepted ones, accepted count [B]). The request emits the path's
    tokens, then the target's token at its last node."""
    b, dev = node_tokens.shape[0], node_tokens.device
    table = shape.child_table().to(dev)
    cur = torch.zeros(b, dtype=torch.long, device=dev)
    alive = torch.ones(b, dtype=torch.bool, device=dev)
    path = torch.zeros(b, shape.depth, dtype=torch.long, device=dev)
    want = target_ids.gather(1, cur[:, None])[:, 0]
    for d in range(shape.depth):
        kids = table[cur]  # [B, k], -1: no such child
        match = (node_tokens.gather(1, kids.clamp(min=0)) == want[:, None]) & (kids >= 0)
        hit = match.any(1) & alive
        nxt = kids.gather(1, match.to(torch.int8).argmax(1, keepdim=True))[:, 0]
        cur = torch.where(hit, nxt, cur)
        path[:, d] = torch.where(hit, nxt, 0)
        alive = hit
        want = target_ids.gather(1, cur[:, None])[:, 0]
    accepted = (path > 0).sum(1)
    return path, accepted


def tree_rejection_accept(shape: TreeShape, logits: torch.Tensor, node_tokens: list[int],
                          params: SamplingParams, gen: torch.Generator | None
                          ) -> tuple[list[int], list[int]]:
    """One sampled request: logits [M + 1, V] at its nodes, node_tokens [M + 1] → (the tokens it
    emits, the indices of its accepted nodes)."""
    node, tokens, path = 0, [], []
    for _ in range(shape.depth):
        probs = target_probs(logits[node], params)
        chosen = None
        for child in shape.children(node):
            c = node_tokens[child]
            total = probs.sum()
            u = torch.rand((), generator=gen, device=probs.device)
            if bool(u * total < probs[c]):
                chosen = child
                break
            probs[c] = 0.0
        if chosen is None:  # (a leaf has no children: its token is drawn from p)
            tokens.append(int(torch.multinomial(probs / probs.sum(), 1, generator=gen)))
            return tokens, path
        tokens.append(node_tokens[chosen])
        path.append(chosen)
        node = chosen
    probs = target_probs(logits[node], params)
    tokens.append(int(torch.multinomial(probs, 1, generator=gen)))
    return tokens, path


def tree_shape(spec: SpecConfig, tree_paths: dict[tuple[int, ...], float] | None) -> TreeShape:
    """The shape `spec` (SpecConfig with topk > 1) asks for: the full tree, or pruned to
    spec.draft_nodes nodes by the draft's rank path counts (`Draft.tree_paths`)."""
    if not spec.num_draft_tokens:
        return TreeShape(spec.topk, spec.num_steps)
    return TreeShape.best(spec.topk, spec.num_steps, spec.draft_nodes, tree_paths)
