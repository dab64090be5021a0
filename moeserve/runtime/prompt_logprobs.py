"""Prompt logprobs in the prefill pass: which positions of a step are scored, and scoring them.

The logprob of prompt token i (i >= 1) is read from the distribution at position i - 1. A prefill
chunk over positions [a, a + n) of a request that asks for prompt logprobs from position `start`
scores positions p in [max(a, start - 1), min(a + n, L - 1)), L the prompt length; position p's
target is prompt token p + 1 (for a chunk's last position, the next chunk's first token, which the
host knows). Position L - 1 gives the first output token and is sampled as usual.

The step keeps its hidden states at every position; the LM head then runs over the scored rows a
block at a time (`SCORE_LOGITS` logits per block), so no [prompt x vocab] tensor is ever whole.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

SCORE_LOGITS = 1 << 24  # logits per LM-head block while scoring (64 MiB in float32)


@dataclass(frozen=True)
class PromptSpan:
    """One request's scored positions in one step."""

    index: int  # the request's index in the step
    row: int  # the first scored position's row in the step's token-major hidden states
    first: int  # the prompt position whose logprob that row gives (its own position + 1)
    targets: list[int]  # prompt tokens at positions first, first + 1, ...
    top: int  # alternatives per position (0: none)


@dataclass
class SpanScores:
    """What one span's rows gave: each target's logprob and rank (1: the argmax), and the top
    alternatives per position when the span asked for them."""

    first: int
    values: list[float]
    ranks: list[int]
    tops: list[list[tuple[int, float]]] | None


def span_of(index: int, row: int, chunk_start: int, chunk_len: int, prompt: list[int],
            start: int, top: int) -> PromptSpan | None:
    """The positions a chunk scores (None: none), `row` being the chunk's first row."""
    lo = max(chunk_start, start - 1, 0)
    hi = min(chunk_start + chunk_len, len(prompt) - 1)
    if lo >= hi:
        return None
    return PromptSpan(index, row + lo - chunk_start, lo + 1, prompt[lo + 1 : hi + 1], top)


@torch.inference_mode()
def score_spans(compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                spans: list[PromptSpan]) -> list[SpanScores]:
    """Each span's logprobs from the step's hidden states [T, H]; `compute_logits` is the model's
    LM head ([R, H] -> [R, V])."""
    dev = hidden.device
    rows = torch.cat([torch.arange(s.row, s.row + len(s.targets)) for s in spans]).to(dev)  # [R]
    targets = torch.tensor([t for s in spans for t in s.targets], dtype=torch.int64).to(dev)
    k = max(s.top for s in spans)
    values, ranks, top_v, top_i = [], [], [], []
    lo, block = 0, 1  # the first block of one row tells the vocabulary size
    while lo < rows.numel():
        logits = compute_logits(hidden[rows[lo : lo + block]]).float()  # [r, V]
        logp = torch.log_softmax(logits, dim=-1)
        chosen = logp.gather(1, targets[lo : lo + logp.shape[0], None])  # [r, 1]
        values.append(chosen[:, 0])
        ranks.append((logp > chosen).sum(-1) + 1)
        if k:
            v, i = logp.topk(k, dim=-1)  # [r, k]
            top_v.append(v)
            top_i.append(i)
        lo += logp.shape[0]
        block = max(1, SCORE_LOGITS // logp.shape[-1])
    values_l = torch.cat(values).tolist()
    ranks_l = torch.cat(ranks).tolist()
    tv = torch.cat(top_v).tolist() if k else None
    ti = torch.cat(top_i).tolist() if k else None
    out, at = [], 0
    for s in spans:
        n = len(s.targets)
        tops = None if not s.top else [list(zip(ti[r][: s.top], tv[r][: s.top]))
                                       for r in range(at, at + n)]
        out.append(SpanScores(s.first, values_l[at : at + n], ranks_l[at : at + n], tops))
        at += n
    return out
