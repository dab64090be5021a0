"""The multi-rank tests' single-process reference: each model's outputs for every workload,
computed once per session (test_dp, test_tbo_dp and test_spec_dp compare against it), in one
Engine per model: the HTTP tests' chat texts too, which cost an Engine start of their own each."""

from __future__ import annotations

import pytest
from dp_workloads import (CHAT_LENS, ONE, QUESTIONS, constrained, ids_of, skew_long_short,
                          staggered, workload)
from live_server import engine_chat_texts
from parity import FP32_CPU

from moeserve import Engine


@pytest.fixture(scope="session")
def reference(tiny_model):
    """Single-process outputs for every workload, per model (built once per session):
    token ids, and for the chats the texts."""
    cache: dict[str, dict] = {}

    def get(arch: str) -> dict:
        if arch not in cache:
            path = tiny_model(arch)
            long_short = skew_long_short()
            with Engine(path, FP32_CPU) as eng:
                ref = {name: ids_of(eng.generate(input_ids=w[0], sampling_params=w[1]))
                       for name, w in (("workload", workload()), ("one", ONE),
                                       ("long_short", long_short), ("staggered", staggered()),
                                       ("constrained", constrained()))}
                ref["chats"] = engine_chat_texts(eng, QUESTIONS, CHAT_LENS)
            cache[arch] = {"path": path, **ref}
        return cache[arch]

    return get
