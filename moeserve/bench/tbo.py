"""`python -m moeserve.bench.tbo`: prefill and decode throughput with two-batch overlap on and
off, side by side, over dp×ep ranks: a tiny DeepSeek-V3 (or another tiny arch) on CPU (gloo), or
with --model DIR --device cuda a real shape on one GPU per rank (NCCL), e.g. a DeepSeek-V3 cut to
a few layers with dummy weights (`-o model.load_format=dummy`).

Each configuration starts its own multi-rank Engine, warms up, then times (1) a prefill-only
round (max_new_tokens=1) and (2) prompts decoding `--output` tokens; decode throughput is the
extra tokens over the extra time. Every timed round has prompts of its own, so no round hits the
prefix cache of an earlier one. --batch counts requests over all ranks (the DP controller spreads
them round-robin): `--ranks 4 --batch 1024` decodes 256 per rank. On CPU, with TBO on, rank 0
records its op timeline (MOESERVE_TBO_TIMELINE; host times, so not on CUDA) and the table adds the
share of in-flight dispatch/combine time during which the other micro-batch ran an op. A table,
not a target: on a 2-core CPU the ranks share cores, so overlap has little idle time to fill.
--show-timeline prints rank 0's op timeline of one MoE layer in one recorded step (docs/tbo.md).

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
from collections.abc import Callable

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


def measure(eng: Engine, batch: int, input_len: int, output: int, repeats: int,
            between: Callable[[], None] = lambda: None) -> tuple[float, float]:
    """(prefill tok/s, decode tok/s): warm-up, then the best of `repeats` prefill-only rounds
    (max_new_tokens=1) and of `repeats` rounds of `output` tokens; decode = the extra tokens over
    the extra time. Every round has prompts of its own (no prefix-cache hits); the same sequence
    of prompts on every call. `between` runs after the warm-up (e.g. start recording)."""
    seeds = iter(range(1, 1000))

    def fresh() -> list[list[int]]:
        return _prompts(batch, input_len, seed=next(seeds))

    _timed(eng, fresh(), 4)
    between()
    t_prefill = min(_timed(eng, fresh(), 1) for _ in range(repeats))
    t_full = min(_timed(eng, fresh(), output) for _ in range(repeats))
    decode_s = max(t_full - t_prefill, 1e-9)
    return batch * input_len / t_prefill, batch * (output - 1) / decode_s


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
    record = tbo and args.device == "cpu"
    if record:
        os.environ["MOESERVE_TBO_TIMELINE"] = timeline
    try:
        eng = Engine(path, opts + args.override)
    finally:
        os.environ.pop("MOESERVE_TBO_TIMELINE", None)
    with eng:
        prefill, decode = measure(eng, args.batch, args.input, args.output, args.repeats)
    return {"prefill_tps": prefill, "decode_tps": decode,
            "overlap": _overlap(timeline) if record else None}


def base_overrides(args) -> list[str]:
    """dp = ep = --ranks, the backend, a prefill chunk that takes a rank's whole batch."""
    per_rank = -(-args.batch // args.ranks)
    chunk = args.chunk or max(per_rank * args.input, 256)
    dtype = ["model.dtype=float32"] if args.device == "cpu" else []
    return [f"device={args.device}", *dtype, f"parallel.tp_size={args.ranks}",
            f"parallel.dp_size={args.ranks}", f"parallel.a2a_backend={args.backend}",
            f"scheduler.chunked_prefill_size={chunk}"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", default="deepseek_v3", help="tiny model arch (without --model)")
    p.add_argument("--model", default=None, help="HF folder (e.g. make_random --config-only)")
    p.add_argument("--name", default=None, help="the model's name in the table")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("-o", "--override", action="append", default=[],
                   help="Hydra override for both engines (repeatable), applied last")
    p.add_argument("--chunk", type=int, default=None,
                   help="scheduler.chunked_prefill_size (default: a rank's batch x input)")
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
    args = p.parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # one intra-op thread per rank process
    work = tempfile.mkdtemp(prefix="moeserve-bench-tbo-")
    path = args.model or make_tiny(args.arch, os.path.join(work, "model"), num_layers=args.layers)
    name = args.name or (os.path.basename(os.path.normpath(args.model)) if args.model
                         else f"tiny {args.arch}")
    rows = {on: run_one(path, base_overrides(args), on, args, os.path.join(work, "timeline"))
            for on in (False, True)}
    comm = "gloo, CPU" if args.device == "cpu" else "NCCL, CUDA"
    per_rank = -(-args.batch // args.ranks)
    print(f"\n{name}, dp{args.ranks}×ep{args.ranks} ({args.backend}, {comm}), {args.batch} "
          f"requests ({per_rank}/rank) × {args.input} prompt tokens, {args.output} output tokens"
          + (f"; {' '.join(args.override)}" if args.override else ""))
    print(f"{'tbo':<5} {'prefill tok/s':>14} {'decode tok/s':>13} {'comm overlapped':>16}")
    for on, r in rows.items():
        ov = "-" if r["overlap"] is None else f"{100 * r['overlap']:.0f}%"
        print(f"{'on' if on else 'off':<5} {r['prefill_tps']:>14.0f} {r['decode_tps']:>13.1f} "
              f"{ov:>16}")
    off, on = rows[False], rows[True]
    print(f"on/off: prefill {on['prefill_tps'] / off['prefill_tps']:.3f}x, decode "
          f"{on['decode_tps'] / off['decode_tps']:.3f}x")
    if args.show_timeline is not None:
        show_timeline(os.path.join(work, "timeline"), args.show_timeline)


if __name__ == "__main__":
    main()
