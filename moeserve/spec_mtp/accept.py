"""Verification: which drafted tokens the target accepts.

The draft is greedy (its distribution q is one-hot on the drafted token d), so speculative
(rejection) sampling reduces to: accept d with probability p(d) under the target's processed
distribution p; on rejection draw from p with d removed and renormalised (max(p - q, 0)); when
every draft is accepted draw a bonus token from the last position's p. Each emitted token is then
distributed exactly as plain sampling would draw it. Greedy requests accept the longest prefix on
which the target's argmax equals the drafts, then take the target's argmax as the bonus.

Nothing here depends on how d was chosen, only on q being one-hot on it: a draft head with a
restricted vocabulary (draft_vocab.py) proposes its argmax over D tokens, still one-hot, so the
emitted tokens keep the target's distribution; a d the target gives probability 0 (outside top-k
or top-p) is always rejected and the draw is from p itself.
"""

from __future__ import annotations

import torch

from moeserve.core import SamplingParams
from moeserve.runtime.sampler import target_probs


def greedy_accept(target_ids: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """target_ids [B, N+1] (argmax at each verified position), drafts [B, N] → accepted draft
    count j [B]; the request's new tokens are target_ids[:, :j+1]."""
    match = (target_ids[:, :-1] == drafts).to(torch.int64)
    return match.cumprod(dim=1).sum(dim=1)


def rejection_accept(logits: torch.Tensor, drafts: list[int], params: SamplingParams,
                     gen: torch.Generator | None) -> list[int]:
    """One sampled request: logits [N+1, V] at its verified positions, its N drafts → the tokens
    it emits (the accepted drafts, then one drawn token)."""
    out: list[int] = []
    for i, d in enumerate(drafts):
        probs = target_probs(logits[i], params)
        u = torch.rand((), generator=gen, device=probs.device)
        if bool(u < probs[d]):
            out.append(d)
            continue
        probs[d] = 0.0
        out.append(int(torch.multinomial(probs / probs.sum(), 1, generator=gen)))
        return out
    probs = target_probs(logits[len(drafts)], params)
    out.append(int(torch.multinomial(probs, 1, generator=gen)))
    return out
