"""`python -m moeserve.bench.serving_grammar`: output tok/s with and without a grammar.

Runs `bench.serving` on one set of random prompts, alternating a plain run and a constrained run
(`--rounds` pairs, the order flipped every round so drift on a shared machine hits both), and prints
every run, the medians and the ratio constrained / plain:

    python -m moeserve.bench.serving_grammar --base-url http://127.0.0.1:30000 --num-prompts 32 \\
        --max-concurrency 16 --random-input-len 128 --random-output-len 128 \\
        --random-range-ratio 1.0 --rounds 3

A fair comparison needs equal work: every request of both runs generates exactly max_tokens tokens
(`ignore_eos` is always sent). A schema the model can complete would end constrained requests
early, so the default grammar is a json_schema that cannot complete within the output length: an
array of at least `--random-output-len` objects (each item takes several tokens), exercising
xgrammar's JSON machinery (keys, strings with a length bound, bounded integers, booleans, commas)
on every token. `--grammar regex` uses a character-class regex longer than any reply instead;
`--grammar-body '{...}'` sends any other request fields (e.g. your own response_format).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from typing import Any

from moeserve.bench.serving import build_parser, run_benchmark

ITEM = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "qty": {"type": "integer", "minimum": 0, "maximum": 999},
    "ok": {"type": "boolean"}}, "required": ["name", "qty", "ok"]}


def grammar_body(kind: str, output_len: int) -> dict[str, Any]:
    """Request fields constraining the output without letting it complete in `output_len`
    tokens."""
    if kind == "json":
        schema = {"type": "array", "items": ITEM, "minItems": max(output_len, 1)}
        return {"response_format": {"type": "json_schema",
                                    "json_schema": {"name": "items", "schema": schema}}}
    if kind == "regex":  # longer than any reply: a token holds far fewer than 32 characters
        return {"regex": f"[a-z ,.]{{{32 * max(output_len, 1)}}}"}
    raise ValueError(f"unknown grammar {kind!r}")


def build_grammar_parser() -> argparse.ArgumentParser:
    p = build_parser()
    p.prog = "python -m moeserve.bench.serving_grammar"
    p.description = "Output tok/s with and without a grammar on the same prompts."
    p.add_argument("--grammar", choices=("json", "regex"), default="json")
    p.add_argument("--grammar-body", default=None,
                   help="JSON object of request fields for the constrained runs (overrides "
                        "--grammar)")
    p.add_argument("--rounds", type=int, default=1, help="plain/constrained pairs")
    return p


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def format_comparison(runs: list[dict[str, Any]]) -> str:
    """Every run, then the medians and the ratio of the constrained median to the plain one."""
    head = (f"{'round':>5} {'mode':<8} {'out tok/s':>10} {'TPOT ms':>8} {'ITL p50 ms':>10} "
            f"{'dur s':>7} {'tokens':>7} {'len!=':>5} {'failed':>6}")
    lines = [f"{' Grammar vs plain (same prompts) ':=^75}", head]
    for r in runs:
        m = r["metrics"]
        lines.append(f"{r['round']:>5} {r['mode']:<8} {m['output_throughput']:>10.2f} "
                     f"{m['mean_tpot_ms']:>8.2f} {m['median_itl_ms']:>10.2f} "
                     f"{m['duration']:>7.2f} {m['total_output_tokens']:>7} "
                     f"{m['output_len_mismatches']:>5} {m['failed']:>6}")
    tput = {mode: [r["metrics"]["output_throughput"] for r in runs if r["mode"] == mode]
            for mode in ("plain", "grammar")}
    plain, constrained = _median(tput["plain"]), _median(tput["grammar"])
    ratio = constrained / plain if plain else 0.0
    lines += ["-" * 75,
              f"median output tok/s: plain {plain:.2f}, grammar {constrained:.2f}; "
              f"grammar / plain = {ratio:.3f} (the grammar costs {(1 - ratio) * 100:.1f}%)",
              "per-round ratios: " + ", ".join(
                  f"{g / p:.3f}" for p, g in zip(tput["plain"], tput["grammar"]) if p)]
    if any(r["metrics"]["output_len_mismatches"] or r["metrics"]["failed"] for r in runs):
        lines.append("warning: some requests failed or generated another length than asked: "
                     "the runs did unequal work")
    return "\n".join(lines)


async def compare(args: argparse.Namespace) -> list[dict[str, Any]]:
    """`args.rounds` pairs of runs (ABBA order); → [{"round", "mode", "metrics"}]."""
    args.ignore_eos = True
    base = json.loads(args.extra_request_body) if args.extra_request_body else {}
    extra = (json.loads(args.grammar_body) if args.grammar_body
             else grammar_body(args.grammar, args.random_output_len))
    bodies = {"plain": base, "grammar": {**base, **extra}}
    quiet, tag, runs = args.quiet, args.tag, []
    args.quiet = True
    for i in range(args.rounds):
        for mode in (("plain", "grammar") if i % 2 == 0 else ("grammar", "plain")):
            args.extra_request_body = json.dumps(bodies[mode])
            args.tag = f"{tag or 'grammar_compare'}:{mode}:{i}"
            runs.append({"round": i, "mode": mode, "metrics": await run_benchmark(args)})
            m = runs[-1]["metrics"]
            print(f"round {i} {mode}: {m['output_throughput']:.2f} output tok/s", file=sys.stderr)
    if not quiet:
        print(format_comparison(runs))
    return runs


def main(argv: list[str] | None = None) -> int:
    args = build_grammar_parser().parse_args(argv)
    runs = asyncio.run(compare(args))
    return 0 if all(r["metrics"]["completed"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
