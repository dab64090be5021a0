"""`python -m moeserve.bench.eplb_skew`: decode throughput and expert balancedness under a Zipf-
skewed router, without EPLB and with EPLB placements from a recorded dump, side by side.

The router skew is the test hook MOESERVE_TEST_ZIPF_ROUTER=--zipf (layers/router_skew.py: a fixed
per-expert logit bias ln p, p Zipf over a layer-seeded permutation; set here for every rank).
Each row starts its own dp×ep Engine (--ranks; a tiny arch on CPU, or --model DIR --device cuda
with `-o model.load_format=dummy`), measures as bench.tbo does (`measure`: warm-up, then prefill-
only and full rounds; the same prompts in every row, so the routed load is the same workload) and
records the expert load of the timed rounds (expert_record_* control ops):
  none        default placement, no redundant experts; its dump seeds the other rows
  eplb        eplb.init_placement=<that dump>: EPLB's placement for this layout, no redundancy
  eplb+R      the same with eplb.num_redundant_experts=R for each --redundant R
Balancedness = mean / max over EP ranks of the tokens their experts processed, measured from each
row's own dump (physical counts), averaged over the MoE layers (dense layers record nothing).
"""

from __future__ import annotations

import argparse
import os
import tempfile

from moeserve.bench.tbo import measure
from moeserve.engine_api import Engine
from moeserve.eplb.algorithm import balancedness
from moeserve.eplb.recorder import ExpertDump, merge_rank_dumps
from moeserve.tools.make_tiny import make_tiny

ZIPF_ENV = "MOESERVE_TEST_ZIPF_ROUTER"


def measured_balancedness(dump: ExpertDump) -> float:
    """Mean over layers with any token of mean/max per-rank load (from the physical counts)."""
    counts = dump.physical_counts.double()  # [L, P]
    layers = counts.sum(-1) > 0
    per_rank = counts[layers].view(int(layers.sum()), dump.ep_size, -1).sum(-1)  # [L', ep]
    return float(balancedness(per_rank).mean()) if per_rank.numel() else float("nan")


def run_variant(path: str, overrides: list[str], args, dump_path: str) -> dict:
    """One Engine: (prefill tok/s, decode tok/s) of the timed rounds, their load dump, its
    balancedness."""
    with Engine(path, overrides) as eng:
        prefill, decode = measure(eng, args.batch, args.input, args.output, args.repeats,
                                  between=lambda: _ok(eng.control("expert_record_start")))
        _ok(eng.control("expert_record_stop"))
        dump = merge_rank_dumps(_ok(eng.control("expert_record_dump")), {"model": path})
    dump.save(dump_path)
    return {"prefill_tps": prefill, "decode_tps": decode,
            "balancedness": measured_balancedness(dump),
            "physical": dump.physical_counts.shape[1], "dump": dump_path}


def _ok(replies: list[dict]) -> list[dict]:
    bad = [r for r in replies if not r["ok"]]
    if bad:
        raise RuntimeError(f"rank {bad[0]['rank']}: {bad[0].get('error', 'failed')}")
    return replies


def base_overrides(args) -> list[str]:
    per_rank = -(-args.batch // args.ranks)
    dtype = ["model.dtype=float32"] if args.device == "cpu" else []
    return [f"device={args.device}", *dtype, f"parallel.tp_size={args.ranks}",
            f"parallel.dp_size={args.ranks}", f"parallel.a2a_backend={args.backend}",
            f"scheduler.chunked_prefill_size={args.chunk or max(per_rank * args.input, 256)}",
            *args.override]


def run_all(path: str, args, work: str) -> dict[str, dict]:
    """Every row, each printed once measured (a run cut short keeps the rows it finished)."""
    base = base_overrides(args)
    rows = {"none": run_variant(path, base, args, os.path.join(work, "dump_none.pt"))}
    print_row("none", rows)
    seed = rows["none"]["dump"]
    for r in [0, *args.redundant]:
        name = "eplb" if r == 0 else f"eplb+{r}"
        rows[name] = run_variant(path, base + [f"eplb.init_placement={seed}",
                                               f"eplb.num_redundant_experts={r}"],
                                 args, os.path.join(work, f"dump_{name}.pt"))
        print_row(name, rows)
    print(f"dumps: {work}", flush=True)
    return rows


def print_row(name: str, rows: dict[str, dict]) -> None:
    r, none = rows[name], rows["none"]["decode_tps"]
    print(f"{name:<10} {r['physical']:>8} {r['balancedness']:>12.3f} {r['decode_tps']:>13.1f} "
          f"{r['decode_tps'] / none:>7.2f}x {r['prefill_tps']:>14.0f}", flush=True)


def main(argv: list[str] | None = None) -> dict[str, dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", default="deepseek_v3", help="tiny model arch (without --model)")
    p.add_argument("--model", default=None, help="HF folder (e.g. make_random --config-only)")
    p.add_argument("--name", default=None, help="the model's name in the title")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--ranks", type=int, default=2, help="dp = ep size")
    p.add_argument("--backend", default="p2p", help="parallel.a2a_backend")
    p.add_argument("--zipf", type=float, default=1.2, help="the router skew's Zipf exponent")
    p.add_argument("--redundant", type=int, nargs="*", default=[8, 16])
    p.add_argument("--batch", type=int, default=16, help="requests over all ranks")
    p.add_argument("--input", type=int, default=64, help="prompt tokens per request")
    p.add_argument("--output", type=int, default=16, help="generated tokens per request")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--chunk", type=int, default=None, help="scheduler.chunked_prefill_size")
    p.add_argument("--dump-dir", default=None, help="where the dumps go (default: a temp dir)")
    p.add_argument("-o", "--override", action="append", default=[],
                   help="Hydra override for every engine (repeatable)")
    args = p.parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    work = args.dump_dir or tempfile.mkdtemp(prefix="moeserve-eplb-skew-")
    os.makedirs(work, exist_ok=True)
    path = args.model or make_tiny(args.arch, os.path.join(work, "model"))
    name = args.name or (os.path.basename(os.path.normpath(path)) if args.model
                         else f"tiny {args.arch}")
    comm = "gloo, CPU" if args.device == "cpu" else "NCCL, CUDA"
    print(f"\n{name}, router skew Zipf({args.zipf}), dp{args.ranks}×ep{args.ranks} "
          f"({args.backend}, {comm}), {args.batch} requests ({-(-args.batch // args.ranks)}/rank)"
          f" × {args.input} prompt tokens, {args.output} output tokens"
          + (f"; {' '.join(args.override)}" if args.override else ""))
    print(f"{'placement':<10} {'physical':>8} {'balancedness':>12} {'decode tok/s':>13} "
          f"{'vs none':>8} {'prefill tok/s':>14}", flush=True)
    old = os.environ.get(ZIPF_ENV)
    os.environ[ZIPF_ENV] = str(args.zipf)  # inherited by the rank processes
    try:
        return run_all(path, args, work)
    finally:
        if old is None:
            os.environ.pop(ZIPF_ENV)
        else:
            os.environ[ZIPF_ENV] = old


if __name__ == "__main__":
    main()
