"""PrefillAdder: which waiting requests join the next prefill step, within token budgets."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from moeserve.core import Req


class AddResult(enum.Enum):
    ADDED = 1
    CHUNKED = 2  # added with only part of its prompt; it continues next step
    NO_ROOM = 3  # KV budget exhausted: stop admitting


def reserved_decode_tokens(req: Req, new_token_ratio: float) -> int:
    """KV a running request is expected to still need for its remaining output."""
    remaining = max(req.sampling.max_new_tokens - len(req.output_ids), 0)
    return int(remaining * new_token_ratio)


def prefill_may_wait(waiting: list[Req], decoding: bool, decodes_since_prefill: int,
                     wait_steps: int, chunk_budget: int) -> bool:
    """scheduler.prefill_wait_steps: new arrivals wait for more while requests decode, up to
    `wait_steps` decode steps after the last prefill, unless a full chunk of prompt tokens is
    waiting already (then one prefill step is as full as it gets)."""
    if not decoding or decodes_since_prefill >= wait_steps:
        return False
    for r in waiting:
        chunk_budget -= len(r.fill_ids)
        if chunk_budget <= 0:
            return False
    return True


def chunk_take(rem_chunk: int, page_size: int) -> int:
    """New tokens a request longer than the step's remaining chunk budget gets: whole pages."""
    return rem_chunk // page_size * page_size or rem_chunk


def static_prefill_steps(lens: list[int], chunk_budget: int,
                         page_size: int = 1) -> list[list[tuple[int, int, int]]]:
    """The prefill steps the scheduler runs for requests of these prompt lengths all waiting at
    once with room in the KV pool: per step, (request, first position, tokens), the request
    chunked in the last step first (PrefillAdder's order and chunk sizes). Benchmarks prefill a
    static batch through it (bench.one_batch), so they chunk as the server does."""
    steps, done, i = [], [0] * len(lens), 0
    while i < len(lens):
        rem, step = chunk_budget, []
        while i < len(lens) and rem > 0:
            extend = lens[i] - done[i]
            take = extend if extend <= rem else chunk_take(rem, page_size)
            step.append((i, done[i], take))
            done[i] += take
            rem -= take
            if done[i] == lens[i]:
                i += 1
        steps.append(step)
    return steps


@dataclass
class PrefillAdder:
    """Admits requests while (a) new prefill tokens fit in the chunk budget and (b) their prompt
    plus a reservation for their output fit in the free + evictable KV minus what running decodes
    are expected to need (a decaying new_token_ratio of their remaining max_new_tokens)."""

    available_tokens: int
    chunk_budget: int
    new_token_ratio: float
    running: list[Req]
    page_size: int = 1
    added: list[Req] = field(default_factory=list)
    extend_lens: list[int] = field(default_factory=list)
    chunked: Req | None = None

    def __post_init__(self) -> None:
        reserved = sum(reserved_decode_tokens(r, self.new_token_ratio) for r in self.running)
        self.rem_total = self.available_tokens - reserved
        self.rem_chunk = self.chunk_budget

    def add_chunk_continuation(self, req: Req) -> AddResult:
        """The request chunked in an earlier step always goes first."""
        return self._add(req, len(req.fill_ids) - req.kv_len, reserve=0)

    def add(self, req: Req, prefix_len: int, locked: int = 0) -> AddResult:
        """`locked`: cached tokens that admitting `req` locked (CacheManager.admit), which left
        the evictable pool the budget counted. NOTE: they are charged here. Uncharged, a batch of
        requests sharing cached prefixes passed the budget, `alloc_slots` then found too little to
        evict, and the scheduler undid the batch and rebuilt the same one every step: a rank with
        waiting requests and an empty pool ran nothing, for ever (a DP deadlock's cause)."""
        extend = len(req.fill_ids) - prefix_len
        reserve = reserved_decode_tokens(req, self.new_token_ratio)
        self.rem_total -= locked
        result = self._add(req, extend, reserve)
        if result == AddResult.NO_ROOM:
            self.rem_total += locked  # the caller releases req, which unlocks its prefix
        return result

    def _add(self, req: Req, extend: int, reserve: int) -> AddResult:
        if self.rem_chunk <= 0 or extend + min(reserve, 1) > self.rem_total:
            return AddResult.NO_ROOM
        if extend > self.rem_chunk:
            self._take(req, chunk_take(self.rem_chunk, self.page_size))
            self.chunked = req
            return AddResult.CHUNKED
        if extend + reserve > self.rem_total and self.added:
            return AddResult.NO_ROOM  # never starve: the first request may run on optimism
        self._take(req, extend)
        self.rem_total -= reserve
        return AddResult.ADDED

    def _take(self, req: Req, n: int) -> None:
        self.added.append(req)
        self.extend_lens.append(n)
        self.rem_total -= n
        self.rem_chunk -= n
