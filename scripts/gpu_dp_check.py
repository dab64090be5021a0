"""dp2 x ep2 on two GPUs (NCCL) against one GPU: greedy outputs of a tiny DeepSeek-V3 must match.

    python scripts/gpu_dp_check.py   (run by scripts/gpu_check.sh multigpu on a 2-GPU machine)
"""

from __future__ import annotations

import random
import sys
import tempfile

from moeserve import Engine
from moeserve.tools.make_tiny import make_tiny


def main() -> int:
    path = make_tiny("deepseek_v3", tempfile.mkdtemp(prefix="tiny-v3-"))
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 3000) for _ in range(rng.randrange(4, 30))] for _ in range(12)]
    sp = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 24}
    base = ["device=cuda", "model.dtype=float32"]
    with Engine(path, base) as eng:
        ref = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=sp)]
    ok = True
    for backend in ("a2a", "allgather", "p2p"):
        dp = base + ["parallel.tp_size=2", "parallel.dp_size=2", f"parallel.a2a_backend={backend}"]
        with Engine(path, dp) as eng:
            outs = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=sp)]
        same = sum(a == b for a, b in zip(outs, ref))
        print(f"{backend}: dp2 x ep2 on NCCL identical to one GPU for {same}/{len(ref)} prompts")
        ok &= same == len(ref)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
