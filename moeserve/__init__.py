"""moeserve: serve DeepSeek-style MoE models (DP attention, expert parallelism, EPLB, TBO, MTP)."""

from moeserve.core import SamplingParams

__all__ = ["Engine", "SamplingParams"]


def __getattr__(name: str):
    if name == "Engine":  # lazy: importing the package must not pull torch models in
        from moeserve.engine_api import Engine

        return Engine
    raise AttributeError(name)
