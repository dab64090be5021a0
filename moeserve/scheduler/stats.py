"""StepLog: a rank's step statistics, logged once per interval (as SGLang's batch lines).

One line says where an interval's wall time went: how many decode, prefill and mixed steps ran,
the mean decode batch, prefill tokens, generated tokens per second, and the load (running,
waiting, KV in use). A served benchmark that falls short of the bare decode step's throughput is
explained by these lines (prefill steps stalling decode, small batches) without a profiler.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from moeserve.core import ForwardMode

logger = logging.getLogger(__name__)


@dataclass
class IntervalCounts:
    decode_steps: int = 0
    decode_reqs: int = 0  # summed over decode steps (mean batch = decode_reqs / decode_steps)
    prefill_steps: int = 0  # EXTEND steps without decodes riding along
    mixed_steps: int = 0  # MIXED steps: prefill chunks plus riding decodes
    prefill_tokens: int = 0
    generated: int = 0  # tokens appended to requests (all step kinds)

    @property
    def steps(self) -> int:
        return self.decode_steps + self.prefill_steps + self.mixed_steps


class StepLog:
    def __init__(self, rank: int, interval_s: float,
                 clock: Callable[[], float] = time.monotonic):
        self.rank, self.interval_s, self.clock = rank, interval_s, clock
        self.counts = IntervalCounts()
        self.start = clock()

    @property
    def enabled(self) -> bool:
        return self.interval_s > 0

    def on_batch(self, mode: ForwardMode, num_reqs: int, prefill_tokens: int) -> None:
        c = self.counts
        if mode.is_decode():
            c.decode_steps += 1
            c.decode_reqs += num_reqs
        elif mode == ForwardMode.MIXED:
            c.mixed_steps += 1
        elif mode == ForwardMode.EXTEND:
            c.prefill_steps += 1
        c.prefill_tokens += prefill_tokens

    def on_generated(self, n: int) -> None:
        self.counts.generated += n

    def maybe_log(self, running: int, waiting: int, used_tokens: int, total_tokens: int) -> None:
        """Log the interval if it is over and had steps; an idle interval restarts silently."""
        now = self.clock()
        if not self.enabled or now - self.start < self.interval_s:
            return
        c, span = self.counts, now - self.start
        if c.steps:
            mean_bs = c.decode_reqs / c.decode_steps if c.decode_steps else 0.0
            logger.info(
                "rank %d: %d steps in %.1f s (decode %d, mean batch %.1f; prefill %d; mixed %d), "
                "prefill %d tok, gen %.0f tok/s, running %d, waiting %d, KV %.1f%%", self.rank,
                c.steps, span, c.decode_steps, mean_bs, c.prefill_steps, c.mixed_steps,
                c.prefill_tokens, c.generated / span, running, waiting,
                100.0 * used_tokens / max(total_tokens, 1))
        self.counts, self.start = IntervalCounts(), now
