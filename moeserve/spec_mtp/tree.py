"""Draft trees (spec.topk > 1): the shape, and which path of a verified tree the target accepts.

A full k-ary tree of depth N in heap order: node 0 is the request's last token x_L (the root), the
children of node i are k*i + 1 .. k*i + k, so depth d holds k^d nodes and the tree has
M = k + k^2 + .. + k^N draft nodes. The children of a node are the draft's top k after it, all
distinct, best first. The target scores every node in one pass; the accepted path walks from the
root into the child whose token the target produces there, as long as one does.

Sampled requests use the multi-candidate form of the chain's rejection rule (accept.py): at each
node the k children are k one-hot drafts tried in turn; child c is accepted with probability r(c)
under the residual r (the target's processed distribution with the children tried so far zeroed
and the rest renormalised). If none is, the emitted token is drawn from r. Each emitted token is
then distributed as p itself: P(c_1) = p(c_1), P(c_2) = (1 - p(c_1)) p(c_2) / (1 - p(c_1)), and so
on, and the final draw covers the rest. When every depth accepts, a bonus token is drawn from the
last node's p.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeserve.core import SamplingParams
from moeserve.runtime.sampler import target_probs


@dataclass(frozen=True)
class TreeShape:
    topk: int
    depth: int  # N: draft steps

    @property
    def nodes(self) -> int:
        """Draft nodes M (the root excluded)."""
        return sum(self.topk ** d for d in range(1, self.depth + 1))

    def level(self, d: int) -> range:
        """Heap indices of the nodes at depth d (0: the root)."""
        first = sum(self.topk ** j for j in range(d))
        return range(first, first + self.topk ** d)

    def depths(self) -> list[int]:
        """Depth of every node, root included ([M + 1])."""
        return [d for d in range(self.depth + 1) for _ in self.level(d)]

    def ancestors(self) -> torch.Tensor:
        """[M + 1, N] long: column j - 1 is the node's ancestor at depth j (itself at its own
        depth), -1 past its depth."""
        out = torch.full((self.nodes + 1, self.depth), -1, dtype=torch.long)
        for i, d in enumerate(self.depths()):
            node = i
            for j in range(d, 0, -1):
                out[i, j - 1] = node
                node = (node - 1) // self.topk
        return out


def greedy_tree_accept(shape: TreeShape, node_tokens: torch.Tensor,
                       target_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """node_tokens [B, M + 1] (drafts in heap order; the root's entry is unused), target_ids
    [B, M + 1] (the target's argmax at every node) → (path [B, N]: heap index of the accepted
    node at each depth, 0 past the accepted ones, accepted count [B]). The request emits the
    path's tokens, then the target's token at its last node."""
    b, k = node_tokens.shape[0], shape.topk
    cur = torch.zeros(b, dtype=torch.long, device=node_tokens.device)
    alive = torch.ones(b, dtype=torch.bool, device=node_tokens.device)
    path = torch.zeros(b, shape.depth, dtype=torch.long, device=node_tokens.device)
    want = target_ids.gather(1, cur[:, None])[:, 0]
    children = torch.arange(1, k + 1, device=node_tokens.device)
    for d in range(shape.depth):
        kids = cur[:, None] * k + children  # [B, k]
        match = node_tokens.gather(1, kids) == want[:, None]
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
    emits, the heap indices of its accepted nodes)."""
    k, node, tokens, path = shape.topk, 0, [], []
    for _ in range(shape.depth):
        probs = target_probs(logits[node], params)
        chosen = None
        for child in range(k * node + 1, k * node + k + 1):
            c = node_tokens[child]
            total = probs.sum()
            u = torch.rand((), generator=gen, device=probs.device)
            if bool(u * total < probs[c]):
                chosen = child
                break
            probs[c] = 0.0
        if chosen is None:
            tokens.append(int(torch.multinomial(probs / probs.sum(), 1, generator=gen)))
            return tokens, path
        tokens.append(node_tokens[chosen])
        path.append(chosen)
        node = chosen
    probs = target_probs(logits[node], params)
    tokens.append(int(torch.multinomial(probs, 1, generator=gen)))
    return tokens, path
