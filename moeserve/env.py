"""Every MOESERVE_* environment variable, typed and read in one place (code reads ENV.x)."""

from __future__ import annotations

import os
from dataclasses import dataclass


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

    @classmethod
    def read(cls) -> Env:
        default_cache = os.path.join(os.path.expanduser("~"), ".cache", "moeserve")
        return cls(cache_dir=os.environ.get("MOESERVE_CACHE_DIR") or default_cache,
                   cc=os.environ.get("CC") or None,
                   triton_interpret=os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
                   tbo_timeline=os.environ.get("MOESERVE_TBO_TIMELINE") or None)


def env() -> Env:
    """Read on each call so tests can monkeypatch the environment."""
    return Env.read()
