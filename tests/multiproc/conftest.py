"""The multi-rank tests' single-process reference: each model's outputs for every workload,
computed once per session (test_dp, test_tbo_dp and test_spec_dp compare against it)."""

from __future__ import annotations

import pytest
from dp_workloads import ONE, constrained, ids_of, skew_long_short, staggered, workload
from parity import FP32_CPU

from moeserve import Engine


@pytest.fixture(scope="session")
def reference(tiny_model):
    """Single-process outputs for every workload, per model (built once per session)."""
    cache: dict[str, dict] = {}

    def get(arch: str) -> dict:
        if arch not in cache:
            path = tiny_model(arch)
            long_short = skew_long_short()
            with Engine(path, FP32_CPU) as eng:
                cache[arch] = {"path": path, **{
                    name: ids_of(eng.generate(input_ids=w[0], sampling_params=w[1]))
                    for name, w in (("workload", workload()), ("one", ONE),
                                    ("long_short", long_short), ("staggered", staggered()),
                                    ("constrained", constrained()))}}
        return cache[arch]

    return get
