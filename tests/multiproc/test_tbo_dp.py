"""Two-batch overlap across ranks: dp2×ep2 Engines with tbo on give the single-process greedy
outputs with every dispatcher that runs on CPU (a2a, allgather, p2p over shared memory), both
scheduler loops, through chunked prefill, an idle rank and ranks with one token each, and dp4×ep4;
the op timeline shows one micro-batch's dispatch/combine in flight while the other computes.

tbo.min_tokens=1 makes every step split, so the small workloads exercise empty and one-token
micro-batches. Harness and workloads are test_dp's.
"""

from __future__ import annotations

import json
import os

import pytest
from parity import FP32_CPU
from dp_workloads import (CHAT_LENS, DP2, DP4, ONE, QUESTIONS, ep_overrides, ids_of,
                          skew_long_short, workload)
from test_dp import one_thread_per_rank  # noqa: F401

from moeserve import Engine

TBO_ON = ["tbo=on", "tbo.min_tokens=1", "scheduler.chunked_prefill_size=16"]
# (model, dispatcher, scheduler loop)
CASES = [("deepseek_v3", "a2a", "normal"), ("qwen3_moe", "allgather", "overlap"),
         ("deepseek_v3", "p2p", "overlap")]


@pytest.fixture(scope="module", params=CASES, ids=["-".join(c) for c in CASES])
def tbo_engine(request, reference, tmp_path_factory):
    arch, backend, loop = request.param
    ref = reference(arch)
    prefix = str(tmp_path_factory.mktemp("tbo") / "timeline")
    os.environ["MOESERVE_TBO_TIMELINE"] = prefix  # inherited by the rank processes
    try:
        eng = Engine(ref["path"], FP32_CPU + DP2 + ep_overrides(backend) + TBO_ON +
                     [f"scheduler.overlap={str(loop == 'overlap').lower()}"])
    finally:
        os.environ.pop("MOESERVE_TBO_TIMELINE", None)
    yield eng, ref, prefix
    eng.shutdown()


def _timeline(prefix: str, rank: int) -> list[dict]:
    with open(f"{prefix}.rank{rank}.jsonl") as f:
        return [json.loads(line) for line in f]


@pytest.mark.timeout(150)
def test_tbo_dp2_workload_matches_single_process(tbo_engine):
    eng, ref, prefix = tbo_engine
    prompts, params = workload()
    assert ids_of(eng.generate(input_ids=prompts, sampling_params=params)) == ref["workload"]
    for rank in (0, 1):
        events = _timeline(prefix, rank)
        spans = [e for e in events if e.get("in_flight")]
        assert {e["mb"] for e in events if "op" in e} == {"a", "b"}
        assert {s["kind"] for s in spans} == {"dispatch", "combine"}
        # some op of micro-batch b ran while a dispatch of a was in flight
        a_disp = [s for s in spans if s["mb"] == "a" and s["kind"] == "dispatch"]
        assert any(e.get("mb") == "b" and e["step"] == s["step"] and e["start"] >= s["start"]
                   and e["end"] <= s["end"] for s in a_disp for e in events if "op" in e)


@pytest.mark.timeout(60)
def test_tbo_dp2_other_rank_idle_and_one_token_each(tbo_engine):
    eng, ref, _ = tbo_engine
    alone = eng.generate(input_ids=ONE[0], sampling_params=ONE[1], dp_ranks=[1])  # rank 0 idle
    assert ids_of(alone) == ref["one"]
    both = eng.generate(input_ids=ONE[0] * 2, sampling_params=ONE[1] * 2, dp_ranks=[0, 1])
    assert ids_of(both) == ref["one"] * 2  # decode steps: one token on each rank


@pytest.mark.timeout(60)
def test_tbo_dp2_chunked_prefill_beside_decodes(tbo_engine):
    eng, ref, _ = tbo_engine
    prompts, params, pins = skew_long_short()
    assert ids_of(eng.generate(input_ids=prompts, sampling_params=params, dp_ranks=pins)) == \
        ref["long_short"]


@pytest.mark.timeout(240)
def test_tbo_dp4_ep4_matches_single_process(reference):
    ref = reference("deepseek_v3")
    with Engine(ref["path"], FP32_CPU + DP4 + ep_overrides("a2a") + TBO_ON) as eng:
        prompts, params = workload()
        assert ids_of(eng.generate(input_ids=prompts, sampling_params=params)) == ref["workload"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("arch,backend", [("deepseek_v3", "a2a"), ("qwen3_moe", "p2p")])
def test_tbo_http_dp2_concurrent_chat_matches_engine(reference, arch, backend):
    """The HTTP server at dp2×ep2 with TBO on every step, 8 concurrent greedy chats through the
    official openai client: the same texts and token counts as the single-process Engine (no EP,
    no TBO; the session's reference)."""
    from live_server import LiveServer, assert_chats_equal, concurrent_chats

    ref = reference(arch)
    live = LiveServer([f"model.path={ref['path']}", *FP32_CPU, *DP2, *ep_overrides(backend),
                       *TBO_ON]).wait_healthy()
    try:
        assert_chats_equal(concurrent_chats(live.url, QUESTIONS, CHAT_LENS), CHAT_LENS,
                           ref["chats"])
    finally:
        live.stop(keep_log=live.proc.returncode not in (None, 0, 1))
