"""Serving benchmark metrics: per-run aggregates from the request results, and the result table
(SGLang's bench_serving layout)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from moeserve.bench.serving_client import RequestResult


def _stats(values: list[float], scale: float = 1000.0) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "median": 0.0, "std": 0.0, "p90": 0.0, "p95": 0.0, "p99": 0.0}
    a = np.asarray(values, dtype=np.float64) * scale
    return {"mean": float(a.mean()), "median": float(np.median(a)), "std": float(a.std()),
            "p90": float(np.percentile(a, 90)), "p95": float(np.percentile(a, 95)),
            "p99": float(np.percentile(a, 99))}


def compute_metrics(results: list[RequestResult], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    failed = [r for r in results if not r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    requested = sum(r.requested_output_len for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itls = [x for r in ok for x in r.itl]
    dur = max(duration, 1e-9)
    m: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(failed),
        "first_error": failed[0].error if failed else "",
        "duration": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "total_requested_output_tokens": requested,
        "output_len_mismatches": sum(r.output_tokens != r.requested_output_len for r in ok),
        "min_output_tokens": min((r.output_tokens for r in ok), default=0),
        "max_output_tokens": max((r.output_tokens for r in ok), default=0),
        "usage_reported": sum(r.usage_output_tokens is not None for r in ok),
        "done_received": sum(r.got_done for r in ok),
        "request_throughput": len(ok) / dur,
        "input_throughput": total_in / dur,
        "output_throughput": total_out / dur,
        "total_throughput": (total_in + total_out) / dur,
        "concurrency": sum(r.latency for r in ok) / dur,  # mean requests in flight (Little's law)
    }
    for name, values in (("e2e_latency", [r.latency for r in ok]), ("ttft", [r.ttft for r in ok]),
                         ("itl", itls), ("tpot", tpots)):
        for stat, value in _stats(values).items():
            m[f"{stat}_{name}_ms"] = value
    return m


# (section title, row label, metric key): SGLang's bench_serving latency blocks, mean/median/p99 each
LATENCY_SECTIONS = (("End-to-End Latency", "E2E Latency", "e2e_latency"),
                    ("Time to First Token", "TTFT", "ttft"),
                    ("Time per Output Token (excl. 1st token)", "TPOT", "tpot"),
                    ("Inter-Token Latency", "ITL", "itl"))


def format_table(m: dict[str, Any], args: argparse.Namespace) -> str:
    def row(label: str, value: Any) -> str:
        if isinstance(value, float):
            value = f"{value:.2f}"
        return f"{label:<40} {value!s:<10}"

    def section(title: str) -> str:
        return f"{title:-^50}"

    lines = [
        f"{' Serving Benchmark Result ':=^50}",
        row("Backend:", args.backend),
        row("Traffic request rate:", args.request_rate),
        row("Max request concurrency:", args.max_concurrency or "not set"),
        row("Successful requests:", m["completed"]),
        row("Failed requests:", m["failed"]),
        row("Benchmark duration (s):", m["duration"]),
        row("Total input tokens:", m["total_input_tokens"]),
        row("Total generated tokens:", m["total_output_tokens"]),
        row("Total requested output tokens:", m["total_requested_output_tokens"]),
        row("Request throughput (req/s):", m["request_throughput"]),
        row("Input token throughput (tok/s):", m["input_throughput"]),
        row("Output token throughput (tok/s):", m["output_throughput"]),
        row("Total token throughput (tok/s):", m["total_throughput"]),
        row("Concurrency:", m["concurrency"]),
    ]
    for title, label, key in LATENCY_SECTIONS:
        lines.append(section(title))
        lines += [row(f"{stat.title()} {label} (ms):", m[f"{stat}_{key}_ms"])
                  for stat in ("mean", "median", "p99")]
    lines.append("=" * 50)
    if m["output_len_mismatches"]:
        lines.append(f"note: {m['output_len_mismatches']} requests generated a different number of "
                     f"tokens than requested ({m['min_output_tokens']}..{m['max_output_tokens']})")
    if m["failed"]:
        lines.append(f"first error: {m['first_error']}")
    return "\n".join(lines)
