"""Structured outputs through xgrammar: compile a request's grammar, match it, mask the logits.

Where each part runs:
- the server process compiles every grammar once when the request arrives, so an invalid schema is
  an HTTP 400 before anything is queued;
- the scheduler compiles it again on a helper thread (`GrammarCompiler.compile_async`; a grammar
  seen before is taken from a cache at once) and admits the request once it is ready
  (scheduler/grammar_intake.py); each request keeps one `GrammarMatch`;
- the forward worker, which runs steps in submission order, applies each step's token bitmask to
  the logits (CPU or CUDA) and hands the sampled tokens to `grammar_steps.GrammarSteps`, whose
  helper thread advances the matchers and fills the next step's bitmask while the next forward
  runs.

A step's inputs say how many generated tokens precede the token it samples; a matcher that accepted
more (tokens of a dropped step, after a retraction) is rolled back to that count.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from moeserve.env import env
from moeserve.host_copy import to_device
from moeserve.runtime.grammar_vocab import tokenizer_info
from moeserve.tokenizer.loading import LazyTokenizer, loaded

KINDS = ("json_object", "json_schema", "regex", "ebnf")
CACHE_SIZE = 256  # compiled grammars kept by GrammarCompiler (xgrammar keeps its own cache too)
_NOISE = re.compile(r"\[[\d:]+\] \S+:\d+: |Check failed: \(.*?\) is false: ")
_HEX2 = re.compile(r"[0-9A-Fa-f]{2}")



def xgrammar_regex(regex: str) -> str:
    """`regex` as Python's `re` reads it (what the API document's `format: regex` promises),
    written so xgrammar's parser reads it the same: a NUL character, bare or escaped, becomes
    `\\u0000` (xgrammar refuses a raw NUL), and `\\xHH` becomes `\\u00HH` (xgrammar's `\\x` takes
    every hex digit that follows, so `\\x41B` was one character to it, two to `re`). Both found
    by the API fuzz test."""
    if "\x00" not in regex and "\\x" not in regex:
        return regex
    out, i = [], 0
    while i < len(regex):
        ch = regex[i]
        if ch == "\\" and i + 1 < len(regex):  # an escape: one pair, read as a whole
            nxt = regex[i + 1]
            if nxt == "x" and _HEX2.fullmatch(regex, i + 2, i + 4):
                out.append("\\u00" + regex[i + 2:i + 4])
                i += 4
                continue
            out.append("\\u0000" if nxt == "\x00" else ch + nxt)
            i += 2
            continue
        out.append("\\u0000" if ch == "\x00" else ch)
        i += 1
    return "".join(out)


class GrammarCompiler:
    """(kind, source) → xgrammar CompiledGrammar, cached; tokenizer info is made on first use
    (grammar_vocab.py: read from the disk cache, else built from the tokenizer).

    `compile` runs on the caller's thread (the server's 400s); `compile_async` on one helper
    thread (xgrammar releases the GIL while it compiles), so the scheduler's loop goes on."""

    def __init__(self, tokenizer: Any, vocab_size: int):
        self._tokenizer, self.vocab_size = tokenizer, vocab_size
        self._compiler: Any = None
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    def cached(self, spec: tuple[str, str]) -> Any | None:
        """The compiled grammar if `spec` was compiled before (a dictionary lookup), else None."""
        with self._lock:
            compiled = self._cache.get(spec)
            if compiled is not None:
                self._cache.move_to_end(spec)
            return compiled

    def compile_async(self, spec: tuple[str, str]) -> Future:
        """A Future of `compile(spec)` (its ValueError included), compiled on a helper thread."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        return self._pool.submit(self.compile, spec)

    def compile(self, spec: tuple[str, str]) -> Any:
        """Raises ValueError naming the problem (bad kind, malformed JSON, unsupported schema)."""
        compiled = self.cached(spec)
        if compiled is None:
            compiled = self._compile(*spec)
            with self._lock:
                self._cache[spec] = compiled
                if len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
        return compiled

    def _compile(self, kind: str, source: str) -> Any:
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
            if kind == "regex":
                return c.compile_regex(xgrammar_regex(source))
            return c.compile_grammar(source)
        except (RuntimeError, ValueError, TypeError) as e:
            raise ValueError(f"invalid {kind}: {_NOISE.sub('', str(e)).strip()}") from None

    def _get(self) -> Any:
        with self._lock:
            if self._compiler is None:
                try:
                    import xgrammar as xgr
                except ImportError:
                    raise ValueError("structured outputs need the xgrammar package") from None
                info = tokenizer_info(_folder(self._tokenizer), self.vocab_size,
                                      lambda: loaded(self._tokenizer), env().cache_dir)
                self._compiler = xgr.GrammarCompiler(info)
            return self._compiler

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def _folder(tokenizer: Any) -> str | None:
    """The folder a tokenizer was loaded from (a LazyTokenizer's, or transformers' name_or_path),
    None where it is not one."""
    path = tokenizer.path if isinstance(tokenizer, LazyTokenizer) else getattr(
        tokenizer, "name_or_path", None)
    return path if isinstance(path, str) and os.path.isdir(path) else None


class GrammarMatch:
    """One request's matcher; `accepted` counts its generated tokens, `done_at` is the count at
    which the grammar (and its stop token) completed. Only one thread uses it at a time: the
    forward worker, or the GrammarSteps helper between two of the worker's steps."""

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


def bitmask_words(vocab: int) -> int:
    """int32 words per bitmask row (xgrammar's layout: bit j of word w is token 32 w + j)."""
    return (vocab + 31) // 32


def apply_token_mask(logits: torch.Tensor, bits: torch.Tensor, rows: list[int], vocab: int,
                     copy: bool) -> torch.Tensor:
    """logits [B, V] with each constrained row's disallowed tokens at -inf, in a few vectorised
    ops. rows: the R constrained rows (ascending); bits: their bitmasks [R, words] (int32, on
    logits' device); vocab: the grammar's vocabulary (columns past it are left as they are).
    `copy`: mask a copy (the raw logits are read later, for logprobs), else in place."""
    n = min(vocab, logits.shape[-1])
    shifts = torch.arange(32, dtype=torch.int32, device=bits.device)
    banned = ((bits.unsqueeze(-1) >> shifts) & 1).view(len(rows), -1)[:, :n] == 0  # [R, n]
    out = logits.clone() if copy else logits
    if len(rows) == out.shape[0]:
        out[:, :n].masked_fill_(banned, float("-inf"))
    else:
        idx = to_device(torch.tensor(rows, dtype=torch.int64), out.device)
        out[idx, :n] = out[idx, :n].masked_fill_(banned, float("-inf"))
    return out
