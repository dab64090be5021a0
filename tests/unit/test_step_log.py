"""StepLog: one line per interval with the steps by kind, mean decode batch and generated tok/s."""

from __future__ import annotations

import logging

from moeserve.core import ForwardMode
from moeserve.scheduler.stats import StepLog


def test_interval_line(caplog):
    now = [0.0]
    log = StepLog(rank=3, interval_s=2.0, clock=lambda: now[0])
    log.on_batch(ForwardMode.EXTEND, 4, 500)
    log.on_batch(ForwardMode.DECODE, 8, 0)
    log.on_batch(ForwardMode.DECODE, 6, 0)
    log.on_batch(ForwardMode.MIXED, 10, 120)
    log.on_generated(30)
    with caplog.at_level(logging.INFO, logger="moeserve.scheduler.stats"):
        now[0] = 1.0
        log.maybe_log(running=10, waiting=2, used_tokens=50, total_tokens=200)
        assert not caplog.records  # the interval is not over yet
        now[0] = 2.5
        log.maybe_log(running=10, waiting=2, used_tokens=50, total_tokens=200)
        now[0] = 5.0  # an idle interval logs nothing
        log.maybe_log(running=0, waiting=0, used_tokens=0, total_tokens=200)
    (line,) = [r.getMessage() for r in caplog.records]
    assert line == ("rank 3: 4 steps in 2.5 s (decode 2, mean batch 7.0; prefill 1; mixed 1), "
                    "prefill 620 tok, gen 12 tok/s, running 10, waiting 2, KV 25.0%")


def test_off_when_interval_is_zero(caplog):
    log = StepLog(rank=0, interval_s=0.0, clock=lambda: 100.0)
    log.on_batch(ForwardMode.DECODE, 1, 0)
    with caplog.at_level(logging.INFO, logger="moeserve.scheduler.stats"):
        log.maybe_log(1, 0, 1, 10)
    assert not log.enabled and not caplog.records
