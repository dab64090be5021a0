"""dp2 x ep2 on two GPUs (NCCL) against one GPU: greedy outputs of a tiny DeepSeek-V3 must match,
and every run must shut down cleanly.

    python scripts/gpu_dp_check.py   (run by scripts/gpu_check.sh multigpu|p2p on a 2-GPU machine)
    DP_CHECK_DEVICE=cpu OMP_NUM_THREADS=1 python scripts/gpu_dp_check.py   (the same on gloo)

The runs happen in a child process of this script; its stderr, which every rank's process
shares, is kept in $OUT/dp_check_stderr.log (the temp dir without $OUT) and searched for what a
clean exit never prints (scheduler/shutdown.py's UNCLEAN_EXIT: c10::Error frames, NCCL/gloo
warnings such as "destroy_process_group() was not called", tracebacks) and for each rank's
ordered-teardown line (2 ranks x 3 dispatchers). Exit 1 on a mismatch or an unclean exit.
"""

from __future__ import annotations

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


def runs() -> int:
    path = make_tiny("deepseek_v3", tempfile.mkdtemp(prefix="tiny-v3-"))
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 3000) for _ in range(rng.randrange(4, 30))] for _ in range(12)]
    sp = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 24}
    base = [f"device={DEVICE}", "model.dtype=float32"]
    comm, one = ("NCCL", "one GPU") if DEVICE == "cuda" else ("gloo", "one process")
    with Engine(path, base) as eng:
        ref = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=sp)]
    ok = True
    for backend in BACKENDS:
        dp = base + ["parallel.tp_size=2", "parallel.dp_size=2", f"parallel.a2a_backend={backend}"]
        with Engine(path, dp) as eng:
            outs = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=sp)]
        same = sum(a == b for a, b in zip(outs, ref))
        print(f"{backend}: dp2 x ep2 on {comm} identical to {one} for {same}/{len(ref)} prompts",
              flush=True)
        ok &= same == len(ref)
    return 0 if ok else 1


def main() -> int:
    if sys.argv[1:] == ["--runs"]:
        return runs()
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--runs"],
                          stderr=subprocess.PIPE, text=True, errors="replace")
    log_path = os.path.join(os.environ.get("OUT") or tempfile.gettempdir(),
                            "dp_check_stderr.log")
    with open(log_path, "w") as f:
        f.write(proc.stderr)
    bad = [line for line in proc.stderr.splitlines() if UNCLEAN_EXIT.search(line)]
    teardowns = len(TEARDOWN_LINE.findall(proc.stderr))
    expected = 2 * len(BACKENDS)
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
