"""Structured outputs through xgrammar: compile a request's grammar, match it, mask the logits.

Where each part runs:
- the server process compiles every grammar once when the request arrives, so an invalid schema is
  an HTTP 400 before anything is queued;
- the scheduler compiles it again when the request reaches it (xgrammar's compiler caches by
  source, so repeats cost a lookup; a new schema costs milliseconds) and keeps one `GrammarMatch`
  per request;
- the forward worker, which runs steps in submission order, fills the token bitmask, applies it to
  the logits (CPU or CUDA) and advances the matcher with the sampled token. The overlap loop's step
  N+1 therefore sees step N's token without the host waiting for it.

A step's inputs say how many generated tokens precede the token it samples; a matcher that accepted
more (tokens of a dropped step, after a retraction) is rolled back to that count.
"""

from __future__ import annotations

import json
import re
from typing import Any

import torch

KINDS = ("json_object", "json_schema", "regex", "ebnf")
_NOISE = re.compile(r"\[[\d:]+\] \S+:\d+: |Check failed: \(.*?\) is false: ")


class GrammarCompiler:
    """(kind, source) → xgrammar CompiledGrammar, cached; tokenizer info is built on first use."""

    def __init__(self, tokenizer: Any, vocab_size: int):
        self._tokenizer, self.vocab_size = tokenizer, vocab_size
        self._compiler: Any = None

    def compile(self, spec: tuple[str, str]) -> Any:
        """Raises ValueError naming the problem (bad kind, malformed JSON, unsupported schema)."""
        kind, source = spec
        if kind not in KINDS:
            raise ValueError(f"unknown grammar kind {kind!r} (one of {', '.join(KINDS)})")
        if kind == "json_schema":
            try:
                json.loads(source)
            except json.JSONDecodeError as e:
                raise ValueError(f"json_schema is not valid JSON: {e}") from None
        c = self._get()
        try:
            if kind == "json_object":  # OpenAI: any JSON object, not any JSON value
                return c.compile_json_schema('{"type": "object"}', any_whitespace=False,
                                             strict_mode=False)
            if kind == "json_schema":  # compact: a small model can otherwise loop on whitespace
                return c.compile_json_schema(source, any_whitespace=False)
            return c.compile_regex(source) if kind == "regex" else c.compile_grammar(source)
        except (RuntimeError, ValueError, TypeError) as e:
            raise ValueError(f"invalid {kind}: {_NOISE.sub('', str(e)).strip()}") from None

    def _get(self) -> Any:
        if self._compiler is None:
            try:
                import xgrammar as xgr
            except ImportError:
                raise ValueError("structured outputs need the xgrammar package") from None
            info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self.vocab_size)
            self._compiler = xgr.GrammarCompiler(info)
        return self._compiler


class GrammarMatch:
    """One request's matcher; `accepted` counts its generated tokens, `done_at` is the count at
    which the grammar (and its stop token) completed."""

    def __init__(self, compiled: Any, stop_token_ids: list[int]):
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stop_token_ids or None)
        self.vocab_size = compiled.tokenizer_info.vocab_size
        self.accepted = 0
        self.done_at: int | None = None

    def sync(self, generated: int) -> bool:
        """Roll back to `generated` tokens; → whether the next token is constrained."""
        if self.accepted > generated:
            self.matcher.rollback(self.accepted - generated)
            self.accepted = generated
            if self.done_at is not None and self.done_at > generated:
                self.done_at = None
        return self.accepted == generated and not self.matcher.is_terminated()

    def accept(self, token: int) -> None:
        self.matcher.accept_token(token)  # False (a token outside the mask) leaves it unchanged
        self.accepted += 1
        if self.matcher.is_terminated() and self.done_at is None:
            self.done_at = self.accepted


def constrained_rows(matches: list[GrammarMatch | None], generated: list[int]) -> list[int]:
    """Rows whose next token the grammar decides (-1 or fewer generated: a prefill chunk)."""
    return [i for i, (m, g) in enumerate(zip(matches, generated))
            if m is not None and g >= 0 and m.sync(g)]


def apply_grammars(logits: torch.Tensor, matches: list[GrammarMatch | None],
                   rows: list[int]) -> torch.Tensor:
    """A copy of `logits` [B, V] with disallowed tokens of `rows` at -inf (so logprobs stay raw)."""
    import xgrammar as xgr

    vocab = matches[rows[0]].vocab_size
    bitmask = xgr.allocate_token_bitmask(logits.shape[0], vocab)  # int32 [B, ceil(V / 32)]
    for i in rows:
        matches[i].matcher.fill_next_token_bitmask(bitmask, i)
    out = logits.clone()
    xgr.apply_token_bitmask_inplace(out, bitmask.to(out.device, non_blocking=True),
                                    vocab_size=min(vocab, out.shape[-1]), indices=rows)
    return out


def accept_tokens(matches: list[GrammarMatch | None], rows: list[int], tokens: list[int]) -> None:
    for i in rows:
        matches[i].accept(tokens[i])
