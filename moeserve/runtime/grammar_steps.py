"""GrammarSteps: a forward worker's grammar work around its steps, most of it on a helper thread.

Per step with constrained requests:
1. `mask(fi)` (worker, after the step's forward is launched): wait for the previous step's job, roll
   matchers back where a step was dropped, and gather the step's bitmask rows — prefilled by that
   job where the matcher is still in the state it was filled in, one batched xgrammar fill for the
   rest (requests new to the step, rolled-back matchers);
2. `apply` masks the logits on their device (pinned, non-blocking copy of the bits on CUDA);
3. `after_step(mask, tokens)` queues the next job on the helper thread: wait for the sampled tokens
   (on CUDA their copy to the host may still be on its way), advance the matchers, then fill the
   bitmask each unfinished matcher needs next. That fill runs while the worker prepares and runs
   the next forward (xgrammar's C++ calls release the GIL).

No two threads touch a matcher at once: the worker waits for the job before step 1, and the
scheduler reads `done_at` only after the Future that `after_step` returns (the tokens accepted).

A speculative verify step (spec_mtp/decoder.py) scores N+1 positions per request, the last token
then N drafts: `verify_mask` walks each constrained request's matcher along its drafts, filling
the bitmask at every position the grammar reaches (then rolls the matcher back), so the target's
distribution at position j is the one plain decoding would mask after accepting d_1..d_j; a draft
the grammar refuses is never accepted, since its target row gives it -inf. `accept_blocks` then
advances the matchers by the emitted tokens, on the worker thread, before the step returns.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from moeserve.host_copy import PendingHost, to_device
from moeserve.runtime.grammar import (GrammarMatch, apply_token_mask, bitmask_words,
                                      constrained_rows)
from moeserve.runtime.step import ForwardInput


@dataclass
class StepMask:
    """The constrained rows of one step, their matchers and bitmasks [R, words] (int32, host)."""

    rows: list[int]
    matches: list[GrammarMatch]
    bits: torch.Tensor

    @property
    def vocab(self) -> int:
        return self.matches[0].vocab_size


@dataclass
class VerifyMask:
    """A verify step's masks: `reqs` the constrained requests (batch indices), `mask` their N+1
    rows each, indexing the flat [B (N+1)] logits."""

    reqs: list[int]
    mask: StepMask


@dataclass
class _Prefilled:
    """Bitmask rows filled after the last step: matcher id → (matcher, its token count, row)."""

    rows: dict[int, tuple[GrammarMatch, int, int]]
    bits: torch.Tensor

    def take(self, matches: list[GrammarMatch]) -> tuple[list[int], list[int]]:
        """→ (source rows here, for the positions of `matches` that can use one; positions)."""
        src, dst = [], []
        for k, m in enumerate(matches):
            hit = self.rows.get(id(m))
            if hit is not None and hit[0] is m and hit[1] == m.accepted:
                src.append(hit[2])
                dst.append(k)
        return src, dst


class GrammarSteps:
    def __init__(self, device: torch.device, bind_thread: Callable[[], None] | None = None):
        self.pinned = device.type == "cuda"
        self._bind = bind_thread
        self._pool: ThreadPoolExecutor | None = None
        self._job: Future | None = None
        self._prefilled: _Prefilled | None = None
        self._batch: Any = None  # xgrammar BatchGrammarMatcher (threads for large batches)
        self.stats = {"filled_rows": 0, "prefilled_rows": 0}

    # ---- worker side --------------------------------------------------------------------------
    def mask(self, fi: ForwardInput) -> StepMask | None:
        """The step's constrained rows and bitmasks; None if no row is constrained."""
        if not any(fi.grammars):
            return None
        self.wait()
        # generated tokens before the sampled one: known tokens minus the prompt
        gen = [p + e - n for p, e, n in zip(fi.prefix_lens, fi.extend_lens, fi.prompt_lens)]
        rows = constrained_rows(fi.grammars, gen)
        if not rows:
            return None
        matches = [fi.grammars[i] for i in rows]
        pre, self._prefilled = self._prefilled, None
        src, dst = pre.take(matches) if pre is not None else ([], [])
        if len(dst) == len(matches) and src == list(range(pre.bits.shape[0])):
            bits = pre.bits  # the same requests in the same order: use the rows as they are
        else:
            bits = self._alloc(len(matches), matches[0].vocab_size)
            if dst:
                bits[dst] = pre.bits[src]
            missing = sorted(set(range(len(matches))) - set(dst))
            if missing:
                self._fill([matches[k] for k in missing], bits, missing)
        self.stats["prefilled_rows"] += len(dst)
        return StepMask(rows, matches, bits)

    def apply(self, logits: torch.Tensor, mask: StepMask, copy: bool) -> torch.Tensor:
        """Disallowed tokens of the constrained rows at -inf (`copy`: in a copy of `logits`)."""
        bits = to_device(mask.bits, logits.device)
        return apply_token_mask(logits, bits, mask.rows, mask.vocab, copy)

    def after_step(self, mask: StepMask, tokens: list[int] | PendingHost) -> Future:
        """Queue advancing the matchers with the step's tokens ([B], all rows) and prefilling their
        next bitmasks; → a Future done once the tokens are accepted."""
        accepted: Future = Future()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar",
                                            initializer=self._bind)
        self._job = self._pool.submit(self._advance, mask, tokens, accepted)
        return accepted

    def verify_mask(self, fi: ForwardInput, drafts: torch.Tensor) -> VerifyMask | None:
        """Bitmasks for a verify step over [x_L, d_1..d_N] per request (drafts [B, N], any
        device; the constrained requests' rows are read to the host); None if no request is
        constrained. Positions after the first draft the grammar refuses (or after it completes)
        repeat the last filled row: acceptance stops before them."""
        if not any(fi.grammars):
            return None
        self.wait()
        self._prefilled = None  # matchers move by whole blocks here: fill afresh next time
        gen = [p + 1 - n for p, n in zip(fi.prefix_lens, fi.prompt_lens)]  # before position L's
        reqs = constrained_rows(fi.grammars, gen)
        if not reqs:
            return None
        n = drafts.shape[1]
        w = n + 1
        host = drafts[torch.tensor(reqs, device=drafts.device)].tolist()
        matches = [fi.grammars[i] for i in reqs]
        bits = self._alloc(len(reqs) * w, matches[0].vocab_size)
        for k, (m, d) in enumerate(zip(matches, host)):
            walked, base = 0, k * w
            for j in range(w):
                if j and m.matcher.is_terminated():  # d_j completed it: the request ends there
                    bits[base + j: base + w] = bits[base + j - 1]
                    break
                m.matcher.fill_next_token_bitmask(bits, base + j)
                if j == n or not m.matcher.accept_token(d[j]):
                    bits[base + j + 1: base + w] = bits[base + j]
                    break
                walked += 1
            if walked:
                m.matcher.rollback(walked)
        self.stats["filled_rows"] += len(reqs) * w
        rows = [i * w + j for i in reqs for j in range(w)]
        return VerifyMask(reqs, StepMask(rows, [m for m in matches for _ in range(w)], bits))

    @staticmethod
    def accept_blocks(vm: VerifyMask, grammars: list, blocks: list[list[int]]) -> None:
        """Advance each constrained request's matcher by its emitted tokens (drafts accepted, then
        the target's own); `done_at` marks where a grammar completed inside the block."""
        for i in vm.reqs:
            for t in blocks[i]:
                grammars[i].accept(t)

    def wait(self) -> None:
        """Until the queued job has run (its error raised here)."""
        if self._job is not None:
            job, self._job = self._job, None
            job.result()

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    # ---- helper thread ------------------------------------------------------------------------
    def _advance(self, mask: StepMask, tokens: list[int] | PendingHost, accepted: Future) -> None:
        try:
            ids = tokens.wait() if isinstance(tokens, PendingHost) else tokens
            for i, m in zip(mask.rows, mask.matches):
                m.accept(ids[i])
        except BaseException as e:
            accepted.set_exception(e)
            raise
        accepted.set_result(None)
        live = [m for m in mask.matches if not m.matcher.is_terminated()]
        if not live:
            return
        bits = self._alloc(len(live), live[0].vocab_size)
        self._fill(live, bits, None)
        self._prefilled = _Prefilled({id(m): (m, m.accepted, k) for k, m in enumerate(live)}, bits)

    # ---- both ---------------------------------------------------------------------------------
    def _alloc(self, n: int, vocab: int) -> torch.Tensor:
        return torch.empty((n, bitmask_words(vocab)), dtype=torch.int32, pin_memory=self.pinned)

    def _fill(self, matches: list[GrammarMatch], bits: torch.Tensor,
              indices: list[int] | None) -> None:
        """Rows `indices` of bits (default 0..len-1) ← the matchers' allowed next tokens, in one
        batched xgrammar call (its C++ loop runs without the GIL, on several threads if big)."""
        if self._batch is None:
            import xgrammar as xgr

            self._batch = xgr.BatchGrammarMatcher()
        self._batch.batch_fill_next_token_bitmask([m.matcher for m in matches], bits, indices)
        self.stats["filled_rows"] += len(matches)
