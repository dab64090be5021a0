"""Every MOESERVE_* environment variable, typed and read in one place (code reads ENV.x)."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Env:
    cache_dir: str  # MOESERVE_CACHE_DIR: converted embedded model and other caches

    @classmethod
    def read(cls) -> Env:
        default_cache = os.path.join(os.path.expanduser("~"), ".cache", "moeserve")
        return cls(cache_dir=os.environ.get("MOESERVE_CACHE_DIR") or default_cache)


def env() -> Env:
    """Read on each call so tests can monkeypatch the environment."""
    return Env.read()
