"""Static-batch generation over the paged KV: prefill every request, then decode until all finish.

Used by the offline Engine until the continuous-batching scheduler replaces it. Each request owns a
row of the ReqToTokenPool and one KV slot per token; everything is freed when it finishes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from moeserve.core import FinishReason, ForwardMode, Req
from moeserve.runtime.model_runner import ModelRunner
from moeserve.runtime.sampler import make_generator, sample


class OutOfKVMemory(RuntimeError):
    pass


class StaticBatchGenerator:
    def __init__(self, runner: ModelRunner, eos_token_ids: set[int],
                 decode_text: Callable[[list[int]], str]):
        self.runner = runner
        self.eos_token_ids = eos_token_ids
        self.decode_text = decode_text

    def run(self, reqs: list[Req]) -> None:
        """Generate for all `reqs` in place (output_ids, finish); frees their memory afterwards."""
        mem = self.runner.memory
        too_long = [r for r in reqs if r.seq_len + r.sampling.max_new_tokens > self.runner.context_len]
        if too_long:
            raise ValueError(f"prompt + max_new_tokens exceeds the context length "
                             f"{self.runner.context_len} (request {too_long[0].rid})")
        for r in reqs:
            if r.sampling.max_new_tokens == 0:
                r.finish = FinishReason("length")
        reqs = [r for r in reqs if not r.finished]
        if not reqs:
            return
        rows = mem.req_to_token.alloc(len(reqs))
        if rows is None:
            raise OutOfKVMemory("more requests than cache.max_running_requests")
        for req, row in zip(reqs, rows):
            req.req_pool_idx = row
        gens = [make_generator(r.sampling, self.runner.device) for r in reqs]
        try:
            self._extend(reqs, gens)
            while running := [(r, g) for r, g in zip(reqs, gens) if not r.finished]:
                self._decode([r for r, _ in running], [g for _, g in running])
        finally:
            self._release(reqs)

    def _alloc(self, n: int) -> torch.Tensor:
        slots = self.runner.memory.allocator.alloc(n)
        if slots is None:
            raise OutOfKVMemory(f"KV pool exhausted ({n} slots requested)")
        return slots

    def _extend(self, reqs: list[Req], gens) -> None:
        lens = [len(r.input_ids) for r in reqs]
        slots = self._alloc(sum(lens))
        offset = 0
        for r, n in zip(reqs, lens):
            self.runner.memory.req_to_token.write(r.req_pool_idx, 0, slots[offset : offset + n])
            r.kv_len, offset = n, offset + n
        fb = self.runner.make_batch(
            ForwardMode.EXTEND, [t for r in reqs for t in r.input_ids],
            [p for n in lens for p in range(n)], slots, [r.req_pool_idx for r in reqs], lens,
            [0] * len(reqs), lens)
        self._step(reqs, gens, fb)

    def _decode(self, reqs: list[Req], gens) -> None:
        slots = self._alloc(len(reqs))
        for r, s in zip(reqs, slots):
            self.runner.memory.req_to_token.write(r.req_pool_idx, r.seq_len - 1, s[None])
            r.kv_len += 1
        seq_lens = [r.seq_len for r in reqs]
        fb = self.runner.make_batch(
            ForwardMode.DECODE, [r.output_ids[-1] for r in reqs], [n - 1 for n in seq_lens],
            slots, [r.req_pool_idx for r in reqs], seq_lens, [n - 1 for n in seq_lens],
            [1] * len(reqs))
        self._step(reqs, gens, fb)

    def _step(self, reqs: list[Req], gens, fb) -> None:
        logits = self.runner.forward(fb)
        next_ids = sample(logits, [r.sampling for r in reqs], gens).tolist()
        for r, tok in zip(reqs, next_ids):
            r.output_ids.append(tok)
            r.finish = self._check_finish(r)

    def _check_finish(self, r: Req) -> FinishReason | None:
        tok, sp = r.output_ids[-1], r.sampling
        if tok in sp.stop_token_ids or (not sp.ignore_eos and tok in self.eos_token_ids):
            return FinishReason("stop", tok)
        if sp.stop:
            text = self.decode_text(r.output_ids)
            for s in sp.stop:
                if s in text:
                    return FinishReason("stop", s)
        if len(r.output_ids) >= sp.max_new_tokens:
            return FinishReason("length")
        return None

    def _release(self, reqs: list[Req]) -> None:
        mem = self.runner.memory
        for r in reqs:
            if r.req_pool_idx is None:
                continue
            mem.allocator.free(mem.req_to_token.req_to_token[r.req_pool_idx, : r.kv_len].clone())
            r.kv_len = 0
            mem.req_to_token.free(r.req_pool_idx)
            r.req_pool_idx = None
