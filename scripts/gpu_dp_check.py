"""dp2 x ep2 on two GPUs (NCCL) against one GPU: greedy outputs of a tiny DeepSeek-V3 must match,
and every run must shut down cleanly.

    python scripts/gpu_dp_check.py   (run by scripts/gpu_check.sh multigpu|p2p on a 2-GPU machine)
    DP_CHECK_DEVICE=cpu OMP_NUM_THREADS=1 python scripts/gpu_dp_check.py   (the same on gloo)
    python scripts/gpu_dp_check.py --ranks 4 --archs deepseek_v3 qwen3_moe   (dp4 x ep4)
    python scripts/gpu_dp_check.py --backends p2p deepep --dtype bfloat16 --hidden 2048 \
        -o parallel.deepep_mode=auto   (real DeepEP: bf16, a hidden size its low-latency kernels
        are built for; bf16 reductions may flip a greedy token, so compare with p2p's count)

--archs, --dtype and --hidden pick the tiny models (make_tiny; --hidden overrides hidden_size),
-o adds Hydra overrides to the dp x ep runs.

The runs happen in a child process of this script; its stderr, which every rank's process
shares, is kept in $OUT/dp_check_stderr.log (the temp dir without $OUT) and searched for what a
clean exit never prints (scheduler/shutdown.py's UNCLEAN_EXIT: c10::Error frames, NCCL/gloo
warnings such as "destroy_process_group() was not called", tracebacks) and for each rank's
ordered-teardown line (2 ranks x 3 dispatchers). Exit 1 on a mismatch or an unclean exit.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile

from moeserve import Engine
from moeserve.scheduler.shutdown import TEARDOWN_LINE, UNCLEAN_EXIT
from moeserve.tools.make_tiny import make_tiny

BACKENDS = ("a2a", "allgather", "p2p")
DEVICE = os.environ.get("DP_CHECK_DEVICE", "cuda")  # cpu: the same check on gloo (a dry run)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2, help="dp = ep size")
    p.add_argument("--backends", nargs="+", default=list(BACKENDS))
    p.add_argument("--archs", nargs="+", default=["deepseek_v3"])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--hidden", type=int, default=None, help="tiny models' hidden_size")
    p.add_argument("-o", "--override", action="append", default=[])
    p.add_argument("--runs", action="store_true", help=argparse.SUPPRESS)  # the child process
    return p.parse_args(argv)


def runs(args: argparse.Namespace) -> int:
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 3000) for _ in range(rng.randrange(4, 30))] for _ in range(12)]
    sp = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 24}
    base = [f"device={DEVICE}", f"model.dtype={args.dtype}"]
    comm, one = ("NCCL", "one GPU") if DEVICE == "cuda" else ("gloo", "one process")
    n = args.ranks
    ep = next((o.split("=", 1)[1] for o in args.override if o.startswith("parallel.ep_size=")), n)
    ok = True
    for arch in args.archs:
        extra = {} if args.hidden is None else {"hidden_size": args.hidden}
        path = make_tiny(arch, tempfile.mkdtemp(prefix=f"tiny-{arch}-"), **extra)
        with Engine(path, base) as eng:
            ref = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=sp)]
        for backend in args.backends:
            dp = base + [f"parallel.tp_size={n}", f"parallel.dp_size={n}",
                         f"parallel.a2a_backend={backend}", *args.override]
            with Engine(path, dp) as eng:
                outs = [o["output_ids"]
                        for o in eng.generate(input_ids=prompts, sampling_params=sp)]
            same = sum(a == b for a, b in zip(outs, ref))
            print(f"{arch} {args.dtype} {backend}: dp{n} x ep{ep} on {comm} identical to {one} "
                  f"for {same}/{len(ref)} prompts", flush=True)
            ok &= same == len(ref)
    return 0 if ok else 1


def main() -> int:
    args = parse_args(sys.argv[1:])
    if args.runs:
        return runs(args)
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--runs", *sys.argv[1:]],
                          stderr=subprocess.PIPE, text=True, errors="replace")
    log_path = os.path.join(os.environ.get("OUT") or tempfile.gettempdir(),
                            "dp_check_stderr.log")
    with open(log_path, "w") as f:
        f.write(proc.stderr)
    bad = [line for line in proc.stderr.splitlines() if UNCLEAN_EXIT.search(line)]
    teardowns = len(TEARDOWN_LINE.findall(proc.stderr))
    expected = args.ranks * len(args.backends) * len(args.archs)
    if bad or teardowns != expected:
        print(f"shutdown: {len(bad)} C++ Error/warning or traceback line(s), {teardowns}/"
              f"{expected} rank teardowns; first lines (all in {log_path}):")
        print("\n".join(bad[:15]))
    else:
        print(f"shutdown: no C++ Error/warning line in any process's stderr, {teardowns}/"
              f"{expected} ordered rank teardowns (stderr in {log_path})")
    print(f"runs exit code {proc.returncode}")
    return proc.returncode or int(bool(bad) or teardowns != expected)


if __name__ == "__main__":
    sys.exit(main())
