"""Randomized DP stress: client aborts at random points while small KV pools force retraction.

A live server per case streams greedy completions from many concurrent clients (`bench.soak`):
a share hang up before their first token or mid-stream, and the pool is small enough that ranks
retract running requests, so aborts land on waiting, running and retracted requests. Mixed in:
regex-constrained and `n`=2 requests, MTP speculation (dp2) and two-batch overlap with the
overlap loop (dp4). Every rank sleeps a seeded random 0..3 ms before each DP sync
(MOESERVE_TEST_SYNC_JITTER), so each seed explores other rank interleavings.

Asserts: no request fails other than the ones hung up on purpose, every completed output equals
the unloaded run of its prompt (each choice of an n=2 request), retractions and aborts happened,
nothing is left in flight and every rank's pools are clean afterwards. Before the admission fix
(PrefillAdder charging the prefixes it locks) such a run stalled with requests waiting on an
empty pool (issue 46); `scripts/soak_dp.sh` is the 10-minute, 256-stream version.
"""

from __future__ import annotations

import asyncio

import pytest
from live_server import LiveServer
from dp_workloads import DP2, DP4
from test_dp import one_thread_per_rank  # noqa: F401

import httpx

from moeserve.bench.soak import soak

SPEC = ["spec.algorithm=nextn", "spec.max_batch_size=0", "spec.num_steps=2"]
# (model, overrides, seed)
CASES = {
    "dp2-mtp-normal": ("deepseek_v3", DP2 + SPEC + ["scheduler.overlap=false",
                                                    "cache.max_total_tokens=240"], 11),
    "dp4-tbo-overlap": ("qwen3_moe", DP4 + ["tbo=on", "tbo.min_tokens=1",
                                            "scheduler.overlap=true",
                                            "cache.max_total_tokens=200"], 5),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(CASES))
def test_aborts_under_retraction_keep_lockstep_and_outputs(tiny_model, case):
    arch, overrides, seed = CASES[case]
    server = LiveServer([f"model.path={tiny_model(arch)}", "model.dtype=float32",
                         "parallel.lockstep_timeout_s=20",
                         # where a server that has decoded a while stands (the ratio decays
                         # per decode step): admission reserves little for running decodes
                         "scheduler.init_new_token_ratio=0.1",
                         *overrides], env={"MOESERVE_TEST_SYNC_JITTER": f"3:{seed}"})
    try:
        server.wait_healthy()
        report = asyncio.run(soak(server.url, minutes=0.12, concurrency=24, disconnect=0.3,
                                  pid=None, prompts=12, seed=seed, lens=(8, 48), outs=(4, 16),
                                  mix=0.4, request_timeout_s=40))
        ranks = httpx.get(server.url + "/server_info", timeout=30).json()["ranks"]
        log = server.log_tail(10**7)
    except BaseException:
        print(server.log_tail(8000))
        raise
    finally:
        server.stop()
    summary = report.summary()
    aborts = {k: sum(r.get(f"aborted_{k}", 0) for r in ranks)
              for k in ("waiting", "running", "retracted")}
    print(case, summary, aborts)
    assert report.failed == [], report.failed[:5]
    assert report.completed >= 20
    assert report.aborted_prefill + report.aborted_stream >= 5
    assert report.retractions > 0, "the pool did not force a retraction"
    assert aborts["running"] > 0 and aborts["waiting"] + aborts["retracted"] > 0, aborts
    assert report.leftover == []  # no request in flight; every rank idle with clean memory
    assert "lockstep stall" not in log
