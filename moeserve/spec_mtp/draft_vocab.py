"""A draft vocabulary: the NextN head scores only the D tokens the target most often emits.

The draft's LM head over the full vocabulary is most of a draft pass (SmolLM2: 49152 x 576 is
~21% of the target's weights against ~3% for the draft's decoder layer), while the target's
answers use far fewer tokens. The trainer counts the tokens of the target's own answers, keeps
the D most frequent (sorted ids, `draft_vocab` in the head's file, `draft_vocab_size` in its
config.json), and trains the head's softmax over those rows of the target's LM head; serving
gathers the same rows at load and maps the drafted index back to its token id.

Lossless by construction: the target verifies every drafted token as before. A greedy request
accepts the longest prefix on which the target's argmax equals the drafts; a sampled request's
rejection rule only needs the draft to be one-hot on the drafted token (accept.py), and a
restricted vocabulary changes which token that is, not the rule. A token outside the vocabulary
can never be drafted, so it costs acceptance, never correctness.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

LADDER = (1024, 2048, 4096, 8192, 16384, 32768)  # sizes whose coverage the trainer reports
DEFAULT_SIZE = 4096  # the trainer's --draft-vocab (and a `dummy` head's): measured in train.py


def answer_tokens(records: Iterable[dict[str, Any]]) -> torch.Tensor:
    """Every answer token of the records (the target's greedy outputs), int64 [n]."""
    parts = [r["tokens"][r["prompt_len"]:].long() for r in records]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def pick_vocab(records: list[dict[str, Any]], size: int, vocab_size: int) -> torch.Tensor:
    """The `size` most frequent answer tokens (ties: lower id first), as sorted int64 ids; when
    the answers use fewer distinct tokens the rest are the lowest unused ids, so the size is
    always `size` (the file's shape does not depend on the data)."""
    size = min(size, vocab_size)
    counts = torch.bincount(answer_tokens(records), minlength=vocab_size).double()
    # a stable order: by count, descending, then by id (a tiny tie-breaker below 1)
    score = counts - torch.arange(vocab_size, dtype=torch.float64) / (2 * vocab_size)
    return torch.sort(score.topk(size).indices).values


def coverage(records: list[dict[str, Any]], vocab: torch.Tensor) -> float:
    """Share of the records' answer tokens inside `vocab` (sorted ids)."""
    toks = answer_tokens(records)
    if not len(toks):
        return 0.0
    return float(in_vocab(toks, vocab).double().mean())


def in_vocab(ids: torch.Tensor, vocab: torch.Tensor) -> torch.Tensor:
    """ids (any shape) → bool: whether each is in `vocab` (sorted ids)."""
    pos = torch.searchsorted(vocab, ids).clamp(max=len(vocab) - 1)
    return vocab[pos] == ids


def to_draft_index(ids: torch.Tensor, vocab: torch.Tensor, missing: int = -100) -> torch.Tensor:
    """Full ids → their index in `vocab` (`missing` where absent: cross_entropy's ignore_index)."""
    pos = torch.searchsorted(vocab, ids).clamp(max=len(vocab) - 1)
    return torch.where(vocab[pos] == ids, pos, torch.full_like(pos, missing))


def coverage_table(train: list[dict[str, Any]], heldout: list[dict[str, Any]],
                   vocab_size: int, chosen: int) -> str:
    """Coverage of the training and held-out answers by the top-D training tokens, per D."""
    sizes = sorted({d for d in LADDER if d < vocab_size} | ({chosen} if chosen else set()))
    lines = ["| draft vocab D | train answers covered | held-out answers covered |",
             "|---|---|---|"]
    for d in sizes:
        v = pick_vocab(train, d, vocab_size)
        mark = " (chosen)" if d == chosen else ""
        lines.append(f"| {d}{mark} | {coverage(train, v):.4f} | {coverage(heldout, v):.4f} |")
    return "\n".join(lines)
