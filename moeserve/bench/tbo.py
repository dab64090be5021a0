"""`python -m moeserve.bench.tbo`: CPU prefill and decode throughput with two-batch overlap on and
off, side by side, on a tiny DeepSeek-V3 (or another tiny arch) over dp×ep ranks (gloo).

Each configuration starts its own multi-rank Engine, warms up, then times (1) a prefill-only
round (max_new_tokens=1) and (2) the same prompts decoding `--output` tokens; decode throughput
is the extra tokens over the extra time. With TBO on, rank 0 records its op timeline
(MOESERVE_TBO_TIMELINE) and the table adds the share of in-flight dispatch/combine time during
which the other micro-batch ran an op. A table, not a target: on a 2-core CPU the ranks share
cores, so overlap has little idle time to fill. --show-timeline prints rank 0's op timeline of one
MoE layer in one recorded step (docs/tbo.md shows one).

The one-device cost of the split alone (ep_size 1, GPU or CPU) is `python -m
moeserve.bench.tbo_overhead`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time

from moeserve.engine_api import Engine
from moeserve.tools.make_tiny import make_tiny


def _prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 3000) for _ in range(length)] for _ in range(n)]


def _timed(eng: Engine, prompts: list[list[int]], max_new: int) -> float:
    params = {"temperature": 0, "ignore_eos": True, "max_new_tokens": max_new}
    start = time.perf_counter()
    eng.generate(input_ids=prompts, sampling_params=params)
    return time.perf_counter() - start


def _timeline(prefix: str):
    from moeserve.tbo.operations import Timeline

    path = f"{prefix}.rank0.jsonl"
    if not os.path.exists(path):
        return None
    tl = Timeline()
    with open(path) as f:
        tl.events = [e for e in map(json.loads, f) if "op" in e]
    return tl


def _overlap(prefix: str) -> float | None:
    tl = _timeline(prefix)
    return None if tl is None else tl.overlap_fraction()


def show_timeline(prefix: str, step: int) -> None:
    """Rank 0's ops of the last MoE layer in recorded step `step` (-1: the last one recorded)."""
    tl = _timeline(prefix)
    if tl is None or not tl.events:
        print("no timeline recorded")
        return
    steps = sorted({e["step"] for e in tl.events})
    step = steps[step] if -len(steps) <= step < 0 else step
    if step not in steps:
        print(f"no recorded TBO step {step} (recorded: {steps})")
        return
    moe = [e["layer"] for e in tl.events if e["step"] == step and e["op"] == "dispatch_start"]
    layer = max(moe) if moe else None
    print(f"\nrank 0, TBO step {step}, layer {layer} (times from the timeline's start):")
    print(tl.render(step, layer))


def run_one(path: str, overrides: list[str], tbo: bool, args, timeline: str) -> dict:
    opts = overrides + (["tbo=on", f"tbo.min_tokens={args.min_tokens}"] if tbo else [])
    if tbo:
        os.environ["MOESERVE_TBO_TIMELINE"] = timeline
    try:
        eng = Engine(path, opts)
    finally:
        os.environ.pop("MOESERVE_TBO_TIMELINE", None)
    with eng:
        prompts = _prompts(args.batch, args.input)
        _timed(eng, _prompts(args.batch, args.input, seed=1), 4)  # warm-up
        t_prefill = min(_timed(eng, prompts, 1) for _ in range(args.repeats))
        t_full = min(_timed(eng, prompts, args.output) for _ in range(args.repeats))
    decode_s = max(t_full - t_prefill, 1e-9)
    return {"prefill_tps": args.batch * args.input / t_prefill,
            "decode_tps": args.batch * (args.output - 1) / decode_s,
            "overlap": _overlap(timeline) if tbo else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", default="deepseek_v3")
    p.add_argument("--ranks", type=int, default=2, help="dp = ep = tp size")
    p.add_argument("--backend", default="a2a", help="parallel.a2a_backend")
    p.add_argument("--batch", type=int, default=16, help="requests (spread over the ranks)")
    p.add_argument("--input", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--output", type=int, default=16, help="generated tokens per request")
    p.add_argument("--min-tokens", type=int, default=2, help="tbo.min_tokens")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--layers", type=int, default=None, help="tiny model layer count")
    p.add_argument("--show-timeline", type=int, default=None, metavar="STEP",
                   help="print rank 0's timeline of one MoE layer in recorded TBO step STEP "
                        "(-1: the last recorded)")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # one intra-op thread per rank process
    work = tempfile.mkdtemp(prefix="moeserve-bench-tbo-")
    path = make_tiny(args.arch, os.path.join(work, "model"), num_layers=args.layers)
    overrides = ["device=cpu", "model.dtype=float32", f"parallel.tp_size={args.ranks}",
                 f"parallel.dp_size={args.ranks}", f"parallel.a2a_backend={args.backend}",
                 f"scheduler.chunked_prefill_size={max(args.batch * args.input, 256)}"]
    rows = {on: run_one(path, overrides, on, args, os.path.join(work, "timeline"))
            for on in (False, True)}
    print(f"\ntiny {args.arch}, dp{args.ranks}×ep{args.ranks} ({args.backend}, gloo, CPU), "
          f"{args.batch} requests × {args.input} prompt tokens, {args.output} output tokens")
    print(f"{'tbo':<5} {'prefill tok/s':>14} {'decode tok/s':>13} {'comm overlapped':>16}")
    for on, r in rows.items():
        ov = "-" if r["overlap"] is None else f"{100 * r['overlap']:.0f}%"
        print(f"{'on' if on else 'off':<5} {r['prefill_tps']:>14.0f} {r['decode_tps']:>13.1f} "
              f"{ov:>16}")
    if args.show_timeline is not None:
        show_timeline(os.path.join(work, "timeline"), args.show_timeline)


if __name__ == "__main__":
    main()
