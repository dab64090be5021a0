"""Speculative decoding across ranks: a dp2×ep2 Engine with spec.algorithm=nextn (the tiny
DeepSeek-V3's MTP layer is a MoE layer, so every draft forward joins the expert all-to-all) gives
the single-process plain greedy outputs — with a long prefill on one rank beside verify steps on
the other (the prefilling rank runs idle draft forwards), an idle rank, and both loops. A rank
that ran a different number of forwards would hang the collectives.
"""

from __future__ import annotations

import pytest
from parity import FP32_CPU
from dp_workloads import DP2, ep_overrides, ids_of, skew_long_short, workload
from test_dp import one_thread_per_rank  # noqa: F401

from moeserve import Engine

SPEC = ["spec.algorithm=nextn", "spec.max_batch_size=0", "spec.num_steps=2",
        "scheduler.chunked_prefill_size=16"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend,loop", [("a2a", "normal"), ("p2p", "overlap")])
def test_spec_dp2_matches_single_process(reference, backend, loop):
    ref = reference("deepseek_v3")
    overrides = FP32_CPU + DP2 + ep_overrides(backend) + SPEC + [
        f"scheduler.overlap={str(loop == 'overlap').lower()}"]
    with Engine(ref["path"], overrides) as eng:
        prompts, params = workload()
        assert ids_of(eng.generate(input_ids=prompts, sampling_params=params)) == ref["workload"]
        prompts, params, ranks = skew_long_short()  # prefill on rank 0, verify steps on rank 1
        outs = eng.generate(input_ids=prompts, sampling_params=params, dp_ranks=ranks)
        assert ids_of(outs) == ref["long_short"]
        assert all(o["meta"]["spec_verify_steps"] > 0 for o in outs[1:])
        one = eng.generate(input_ids=prompts[1:2], sampling_params=params[1:2], dp_ranks=[1])
        assert ids_of(one) == ref["long_short"][1:2]  # rank 0 idle the whole time


@pytest.mark.timeout(300)
def test_spec_with_tbo_dp2_matches_single_process(reference, tmp_path, monkeypatch):
    """MTP and two-batch overlap together: verify steps never split (a verifying rank vetoes it,
    on every rank), prefill and stepped-aside decode steps may; outputs stay the plain ones and
    some steps did run as two micro-batches."""
    import json

    ref = reference("deepseek_v3")
    prefix = str(tmp_path / "timeline")
    monkeypatch.setenv("MOESERVE_TBO_TIMELINE", prefix)  # inherited by the rank processes
    overrides = FP32_CPU + DP2 + ep_overrides("a2a") + SPEC + ["tbo=on", "tbo.min_tokens=1"]
    with Engine(ref["path"], overrides) as eng:
        prompts, params = workload()
        outs = eng.generate(input_ids=prompts, sampling_params=params)
        assert ids_of(outs) == ref["workload"]
        assert any(o["meta"].get("spec_verify_steps", 0) > 0 for o in outs)
        prompts, params, ranks = skew_long_short()
        outs = eng.generate(input_ids=prompts, sampling_params=params, dp_ranks=ranks)
        assert ids_of(outs) == ref["long_short"]
    for rank in (0, 1):
        with open(f"{prefix}.rank{rank}.jsonl") as f:
            events = [json.loads(line) for line in f]
        assert {e["mb"] for e in events if "op" in e} == {"a", "b"}  # split steps ran
