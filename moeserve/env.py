"""Every MOESERVE_* environment variable, typed and read in one place (code reads ENV.x)."""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass


# The variables that force one CPU fast path off (see Env): tests of the fast paths themselves
# clear them, so that the suite passes whichever of them a run sets.
FAST_PATH_FLAGS = ("MOESERVE_DISABLE_CPU_KERNELS", "MOESERVE_DISABLE_MARCH_NATIVE",
                   "MOESERVE_DISABLE_BF16_HEAD", "MOESERVE_DISABLE_ONEDNN_BF16",
                   "MOESERVE_DISABLE_CPU_LINEAR")


@dataclass(frozen=True)
class Env:
    cache_dir: str  # MOESERVE_CACHE_DIR: converted embedded model, compiled kernels, other caches
    cc: str | None  # CC (the usual variable): the C compiler of the CPU kernels; None: cc, gcc
    # TRITON_INTERPRET=1 (Triton's own variable): Triton kernels run on CPU tensors in Triton's
    # interpreter, so attention.backend=triton / moe.backend=triton work without a GPU (tests)
    triton_interpret: bool
    # MOESERVE_TBO_TIMELINE=PREFIX: each rank writes PREFIX.rank{r}.jsonl, the start/end of every
    # op of each micro-batch over its first two-batch-overlap steps (tbo/operations.Timeline)
    tbo_timeline: str | None
    # MOESERVE_STEP_TIMELINE=PREFIX: each scheduler rank writes PREFIX.rank{r}.{pid}.jsonl, one
    # line per loop iteration: its phases, what the loop did besides the step, and how long the
    # loop thread waited for its core (scheduler/timeline.py)
    step_timeline: str | None
    # MOESERVE_DISABLE_<PATH>=1 forces one CPU fast path's run-time probe off (its torch fallback
    # runs, as on a CPU without it; tests use these to run every fallback on any machine):
    disable_cpu_kernels: bool  # MOESERVE_DISABLE_CPU_KERNELS: the C decode kernels (kernels/cpu/)
    disable_march_native: bool  # MOESERVE_DISABLE_MARCH_NATIVE: build them without -march=native
    disable_bf16_head: bool  # MOESERVE_DISABLE_BF16_HEAD: the AVX512-BF16 greedy LM head
    disable_onednn_bf16: bool  # MOESERVE_DISABLE_ONEDNN_BF16: oneDNN's bf16 linear prepack
    # MOESERVE_DISABLE_CPU_LINEAR: the C bf16-weight linear (bf16 models where oneDNN's prepack
    # is off; model.dtype=auto then picks float32 on CPUs without native bf16)
    disable_cpu_linear: bool
    # MOESERVE_TEST_REBALANCE_PAUSE_S=S (tests only, default 0): in a live EPLB rebalance the last
    # EP rank logs a line and sleeps S seconds after the load all-reduce, before the weight moves
    # (its peers wait for it in their transfers), so a fault test can kill a rank mid-rebalance
    test_rebalance_pause_s: float
    # MOESERVE_TEST_PREFILL_PAUSE_S=S (tests only, default 0): under elastic EP, the last rank of
    # the group logs a line and sleeps S seconds right after the DP sync of a prefill step (its
    # peers wait for it inside that step's collectives), once per deployment, so a fault test
    # can kill a rank during a prefill step
    test_prefill_pause_s: float
    # MOESERVE_TEST_ZIPF_ROUTER=S (tests and benchmarks only, default 0 = off): every MoE router
    # adds a fixed per-expert logit bias ln p, p a Zipf(S) popularity over a layer-seeded
    # permutation of the experts (layers/router_skew.py), to measure EPLB under a known skew
    test_zipf_router: float
    # MOESERVE_TEST_RANDOM_ROUTER=1 (benchmarks and tests only, default off): every MoE router's
    # logits are replaced by a random permutation per token, so tokens pick uniform random experts
    # (layers/router_skew.py): the balanced load that dummy weights do not give
    test_random_router: bool
    # MOESERVE_TEST_SYNC_JITTER=MS[:SEED] (tests only, default off): before each DP sync every
    # rank sleeps a random 0..MS ms (seeded by SEED and the rank), so a stress test explores
    # other interleavings of ranks, aborts and retractions than this machine's timing gives
    test_sync_jitter: tuple[float, int] | None
    # OMP_NUM_THREADS (OpenMP's own variable): where set, a cap on the forward threads of each
    # process (usable_cpus), as torch itself would honour it had we not set the count
    omp_num_threads: int | None

    @classmethod
    def read(cls) -> Env:
        default_cache = os.path.join(os.path.expanduser("~"), ".cache", "moeserve")
        return cls(cache_dir=os.environ.get("MOESERVE_CACHE_DIR") or default_cache,
                   cc=os.environ.get("CC") or None,
                   triton_interpret=os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
                   tbo_timeline=os.environ.get("MOESERVE_TBO_TIMELINE") or None,
                   step_timeline=os.environ.get("MOESERVE_STEP_TIMELINE") or None,
                   disable_cpu_kernels=_flag("MOESERVE_DISABLE_CPU_KERNELS"),
                   disable_march_native=_flag("MOESERVE_DISABLE_MARCH_NATIVE"),
                   disable_bf16_head=_flag("MOESERVE_DISABLE_BF16_HEAD"),
                   disable_onednn_bf16=_flag("MOESERVE_DISABLE_ONEDNN_BF16"),
                   disable_cpu_linear=_flag("MOESERVE_DISABLE_CPU_LINEAR"),
                   test_rebalance_pause_s=float(
                       os.environ.get("MOESERVE_TEST_REBALANCE_PAUSE_S") or 0),
                   test_prefill_pause_s=float(
                       os.environ.get("MOESERVE_TEST_PREFILL_PAUSE_S") or 0),
                   test_zipf_router=float(os.environ.get("MOESERVE_TEST_ZIPF_ROUTER") or 0),
                   test_random_router=_flag("MOESERVE_TEST_RANDOM_ROUTER"),
                   test_sync_jitter=_jitter(os.environ.get("MOESERVE_TEST_SYNC_JITTER")),
                   omp_num_threads=_positive_int(os.environ.get("OMP_NUM_THREADS")))


def _jitter(value: str | None) -> tuple[float, int] | None:
    if not value:
        return None
    ms, _, seed = value.partition(":")
    return float(ms), int(seed or 0)


def _positive_int(value: str | None) -> int | None:
    try:
        n = int(value or "")
    except ValueError:
        return None
    return n if n > 0 else None


def usable_cpus() -> int:
    """The cores this process may run on: its affinity mask (taskset, a container's cpuset), not
    the host's count, capped by OMP_NUM_THREADS where set. Forward threads beyond it spin in
    OpenMP barriers against each other (seen: a tiny model's decode 30x slower)."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        n = os.cpu_count() or 1
    cap = env().omp_num_threads
    return max(1, min(n, cap) if cap else n)


def _flag(name: str) -> bool:
    return os.environ.get(name, "0").strip().lower() not in ("", "0", "false", "no")


def env() -> Env:
    """Read on each call so tests can monkeypatch the environment."""
    return Env.read()


@functools.cache
def log_forced_off(var: str, path: str) -> None:
    """The one log line of a fast path forced off by its MOESERVE_DISABLE_* variable."""
    logging.getLogger("moeserve.env").info("%s is set: %s off, torch fallback instead", var, path)
