"""Prometheus metrics of the serving process, in a registry owned by the app (not the global one).

Two sources: the schedulers' periodic LoadReports (running/waiting requests, KV usage, cache
hits) and the tokenizer manager's own timings of each request (TTFT, inter-token latency,
end-to-end latency) and token counters. A private registry keeps several apps in one process
(tests) from colliding.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from moeserve.ipc.messages import LoadReport

PREFIX = "moeserve:"
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5,
                    2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2,
                0.3, 0.5, 0.75, 1.0, 2.0, 5.0)


class Metrics:
    """All metrics of one server; `observe_load` and `RequestTimer` feed it."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        reg, rank = self.registry, ["rank"]
        self.running = Gauge(PREFIX + "num_running_reqs", "Requests being decoded", rank,
                             registry=reg)
        self.waiting = Gauge(PREFIX + "num_waiting_reqs", "Requests waiting for admission", rank,
                             registry=reg)
        self.kv_usage = Gauge(PREFIX + "kv_cache_usage_ratio", "Used / total KV slots", rank,
                              registry=reg)
        self.cache_hit_rate = Gauge(PREFIX + "cache_hit_rate",
                                    "Prompt tokens served from the prefix cache / prompt tokens "
                                    "admitted (cumulative)", rank, registry=reg)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of finished requests",
                                     registry=reg)
        self.cached_tokens = Counter(PREFIX + "cached_prompt_tokens",
                                     "Prompt tokens of finished requests found in the prefix cache",
                                     registry=reg)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens",
                                         registry=reg)
        self.requests = Counter(PREFIX + "requests", "Finished requests", ["finish_reason"],
                                registry=reg)
        self.aborted = Counter(PREFIX + "aborted_requests",
                               "Requests aborted by the server (client gone, error)", registry=reg)
        self.eplb_balancedness = Gauge(PREFIX + "eplb_balancedness",
                                       "Mean/max expected tokens per EP rank under the current "
                                       "expert placement, after the last rebalance", rank,
                                       registry=reg)
        self.spec_verify_steps = Counter(PREFIX + "spec_verify_steps",
                                         "Speculative verify passes of finished requests",
                                         registry=reg)
        self.spec_draft_tokens = Counter(PREFIX + "spec_draft_tokens",
                                         "Draft tokens proposed to finished requests", registry=reg)
        self.spec_accepted_tokens = Counter(PREFIX + "spec_accepted_tokens",
                                            "Tokens produced by verify passes (accepted + bonus)",
                                            registry=reg)
        self.spec_accept_length = Histogram(PREFIX + "spec_accept_length",
                                            "Tokens per verify pass, per finished request",
                                            buckets=(1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6,
                                                     9), registry=reg)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token",
                              buckets=_LATENCY_BUCKETS, registry=reg)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between output tokens",
                             buckets=_ITL_BUCKETS, registry=reg)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Request latency",
                             buckets=_LATENCY_BUCKETS, registry=reg)
        self.kv_transfer = KVTransferMetrics(reg)

    def observe_load(self, report: LoadReport) -> None:
        rank = str(report.rank)
        self.running.labels(rank).set(report.running)
        self.waiting.labels(rank).set(report.waiting)
        self.kv_usage.labels(rank).set(report.used_tokens / max(report.max_total_tokens, 1))
        if report.prompt_tokens > 0:
            self.cache_hit_rate.labels(rank).set(report.cache_hit_tokens / report.prompt_tokens)
        if report.eplb_balancedness >= 0:
            self.eplb_balancedness.labels(rank).set(report.eplb_balancedness)
        if report.disagg:
            self.kv_transfer.observe(rank, report.disagg)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class KVTransferMetrics:
    """PD disaggregation's KV transfers per rank and role, from the ranks' cumulative counts
    (disaggregation/role.py: TransferCounters); the mean latency is seconds / transfers."""

    KEYS = ("transfers", "bytes", "failures", "seconds")
    HELP = {"transfers": "KV transfers completed", "bytes": "KV bytes transferred",
            "failures": "Requests whose KV transfer failed or timed out",
            "seconds": "Summed KV transfer latency (prefill: the write; decode: ask to arrival)"}

    def __init__(self, reg: CollectorRegistry):
        names = {"transfers": "kv_transfers", "bytes": "kv_transfer_bytes",
                 "failures": "kv_transfer_failures", "seconds": "kv_transfer_seconds"}
        self.counters = {k: Counter(PREFIX + names[k], self.HELP[k], ["rank", "role"],
                                    registry=reg) for k in self.KEYS}
        self.seen: dict[tuple[str, str], float] = {}

    def observe(self, rank: str, counts: dict) -> None:
        role = str(counts.get("role", ""))
        for k in self.KEYS:
            now, before = float(counts.get(k, 0)), self.seen.get((rank, k), 0.0)
            if now > before:
                self.counters[k].labels(rank, role).inc(now - before)
                self.seen[(rank, k)] = now


@dataclass
class RequestTimer:
    """Timings of one (sub-)request as seen by the tokenizer manager."""

    metrics: Metrics
    start: float = field(default_factory=time.perf_counter)
    last: float | None = None  # time of the last output that carried tokens

    def on_tokens(self, num_new: int) -> None:
        """Record an output carrying `num_new` tokens (ITL is spread over the tokens of a chunk)."""
        if num_new <= 0:
            return
        now = time.perf_counter()
        if self.last is None:
            self.metrics.ttft.observe(now - self.start)
        else:
            per_token = (now - self.last) / num_new
            for _ in range(num_new):
                self.metrics.itl.observe(per_token)
        self.last = now
        self.metrics.generation_tokens.inc(num_new)

    def on_finish(self, finish_reason: str, prompt_tokens: int, cached_tokens: int,
                  spec: tuple[int, int, int] = (0, 0, 0)) -> None:
        """`spec`: the request's (verify steps, draft tokens, accepted tokens)."""
        m = self.metrics
        if spec[0]:
            m.spec_verify_steps.inc(spec[0])
            m.spec_draft_tokens.inc(spec[1])
            m.spec_accepted_tokens.inc(spec[2])
            m.spec_accept_length.observe(spec[2] / spec[0])
        self.metrics.e2e.observe(time.perf_counter() - self.start)
        self.metrics.requests.labels(finish_reason).inc()
        self.metrics.prompt_tokens.inc(prompt_tokens)
        self.metrics.cached_tokens.inc(cached_tokens)
