"""Logit edits before sampling: frequency, presence and repetition penalties and logit_bias.

Batched on the device: the token history of every penalised request is gathered from the device
token table (`ReqToTokenPool.token_ids`, which the overlap loop already keeps current), counted with
one scatter per batch, and the penalties are applied as whole-tensor ops over [P, V]. The host only
builds a few small per-batch tensors; nothing loops over requests in the tensor math.

Order: penalties on the raw logits, then logit_bias (so a -100 ban stays a ban whatever the
penalties do). Frequency/presence count generated tokens only (OpenAI, vLLM); repetition covers the
prompt and the generated tokens (transformers' RepetitionPenaltyLogitsProcessor, vLLM).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeserve.core import SamplingParams


@dataclass
class LogitEdits:
    """Host-built description of one batch's logit edits; `None` parts are skipped."""

    penalised: torch.Tensor | None  # [P] batch rows with penalties
    frequency: torch.Tensor | None  # [P, 1] float32
    presence: torch.Tensor | None  # [P, 1]
    repetition: torch.Tensor | None  # [P, 1]
    bias_rows: torch.Tensor | None  # [N] batch row of each bias entry
    bias_tokens: torch.Tensor | None  # [N]
    bias_values: torch.Tensor | None  # [N] float32

    @classmethod
    def build(cls, params: list[SamplingParams]) -> LogitEdits | None:
        """None when no request edits its logits (the common case costs one pass over params)."""
        if not any(p.edits_logits for p in params):
            return None
        pen = [i for i, p in enumerate(params) if p.has_penalties]
        col = lambda vals: torch.tensor(vals, dtype=torch.float32)[:, None]  # noqa: E731
        bias = [(i, t, b) for i, p in enumerate(params) for t, b in p.logit_bias]
        rows, toks, vals = zip(*bias) if bias else ((), (), ())
        return cls(
            penalised=torch.tensor(pen, dtype=torch.int64) if pen else None,
            frequency=col([params[i].frequency_penalty for i in pen]) if pen else None,
            presence=col([params[i].presence_penalty for i in pen]) if pen else None,
            repetition=col([params[i].repetition_penalty for i in pen]) if pen else None,
            bias_rows=torch.tensor(rows, dtype=torch.int64) if bias else None,
            bias_tokens=torch.tensor(toks, dtype=torch.int64) if bias else None,
            bias_values=torch.tensor(vals, dtype=torch.float32) if bias else None)


def token_counts(token_table: torch.Tensor, rows: torch.Tensor, starts: torch.Tensor,
                 ends: torch.Tensor, vocab: int) -> torch.Tensor:
    """How often each token occurs at positions [starts[i], ends[i]) of table row rows[i].

    token_table: [R, L] int64; rows, starts, ends: [P] int64 (same device) → [P, V] float32.
    """
    width = int(ends.max()) if ends.numel() else 0
    ids = token_table[rows, :width]  # [P, W]
    pos = torch.arange(width, device=ids.device)[None, :]
    inside = ((pos >= starts[:, None]) & (pos < ends[:, None])).float()  # [P, W]
    counts = torch.zeros((rows.numel(), vocab), dtype=torch.float32, device=ids.device)
    return counts.scatter_add_(1, ids, inside)


def apply_penalties(logits: torch.Tensor, output_counts: torch.Tensor, seen: torch.Tensor,
                    frequency: torch.Tensor, presence: torch.Tensor,
                    repetition: torch.Tensor) -> torch.Tensor:
    """logits, output_counts: [P, V] float32; seen: [P, V] bool (prompt or output); penalty
    columns [P, 1] → penalised logits [P, V] (new tensor)."""
    rep = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen, rep, logits)
    return logits - output_counts * frequency - (output_counts > 0).float() * presence


def edit_logits(logits: torch.Tensor, edits: LogitEdits, token_table: torch.Tensor,
                rows: torch.Tensor, prompt_lens: torch.Tensor, known_lens: torch.Tensor
                ) -> torch.Tensor:
    """logits [B, V] → float32 [B, V] with every edit applied.

    rows: [B] token-table rows; prompt_lens: [B] prompt lengths; known_lens: [B] tokens in the
    table before this step's sample (prompt + generated so far). All on the logits' device.
    """
    out = logits.float().clone() if logits.dtype == torch.float32 else logits.float()
    dev, vocab = out.device, out.shape[1]
    if edits.penalised is not None:
        p = edits.penalised.to(dev)
        r, plen, known = rows[p], prompt_lens[p], known_lens[p]
        gen = token_counts(token_table, r, plen, known, vocab)  # [P, V]
        seen = token_counts(token_table, r, torch.zeros_like(plen), known, vocab) > 0
        out[p] = apply_penalties(out[p], gen, seen, edits.frequency.to(dev),
                                 edits.presence.to(dev), edits.repetition.to(dev))
    if edits.bias_rows is not None:
        out.index_put_((edits.bias_rows.to(dev), edits.bias_tokens.to(dev)),
                       edits.bias_values.to(dev), accumulate=True)
    return out
