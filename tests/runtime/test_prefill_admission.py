"""Prefill admission under staggered arrivals (one new request per scheduler step, as a busy server
sees them): MIXED steps and scheduler.prefill_wait_steps keep greedy outputs equal to one request at
a time, and the wait serves several arrivals per prefill step."""

from __future__ import annotations

import random

import pytest
from parity import FP32_CPU

from moeserve import Engine
from moeserve.core import ForwardMode, SamplingParams
from moeserve.ipc.messages import GenerateReq

N = 12


def workload(seed: int = 3) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, 5000) for _ in range(rng.randrange(3, 30))] for _ in range(N)]
    return prompts, [rng.randrange(4, 20) for _ in range(N)]


def drive(eng: Engine, prompts: list[list[int]], lengths: list[int]) -> tuple[list, int]:
    """Step the engine's scheduler by hand, one arrival before each step → (output ids per
    request, prefill steps run: EXTEND or MIXED)."""
    sched = eng.scheduler
    pending = [GenerateReq(rid=f"s{i}", input_ids=p, sampling=SamplingParams.from_dict(
        {"temperature": 0, "ignore_eos": True, "max_new_tokens": n}))
        for i, (p, n) in enumerate(zip(prompts, lengths))]
    prefills = 0
    while pending or sched.has_work():
        if pending:
            sched.add_request(pending.pop(0))
        batch, _ = sched.next_synced_batch(False)
        if batch is None:
            continue
        prefills += batch.mode in (ForwardMode.EXTEND, ForwardMode.MIXED)
        sched.process_result(batch, sched.worker.submit(batch.forward_input).result())
    outs = [[t for o in sched.io.outputs[f"s{i}"] for t in o.new_ids] for i in range(N)]
    sched.cache.free_deferred_rows()  # as the loops do once nothing is in flight
    assert sched.is_memory_clean()
    return outs, prefills


@pytest.fixture(scope="module")
def expected(tiny_model):
    path = tiny_model("qwen3")
    prompts, lengths = workload()
    with Engine(path, FP32_CPU + ["scheduler.disable_radix_cache=true"]) as eng:
        outs = [eng.generate(input_ids=[p], sampling_params={
            "temperature": 0, "ignore_eos": True, "max_new_tokens": n})[0]["output_ids"]
            for p, n in zip(prompts, lengths)]
    return path, prompts, lengths, outs


@pytest.mark.parametrize("mixed", [False, True])
def test_prefill_wait_merges_arrivals(expected, mixed):
    path, prompts, lengths, want = expected
    base = FP32_CPU + ["scheduler.overlap=false", f"scheduler.mixed_chunk={str(mixed).lower()}"]
    with Engine(path, base) as eng:
        outs, eager = drive(eng, prompts, lengths)
        assert outs == want
        assert eager == N  # every arrival prefilled in its own step
        assert (eng.scheduler.stats["mixed_steps"] > 0) == mixed
    with Engine(path, base + ["scheduler.prefill_wait_steps=3"]) as eng:
        outs, waited = drive(eng, prompts, lengths)
        assert outs == want
        assert waited <= N // 2  # about one prefill step per 4 arrivals


def test_full_chunk_does_not_wait(expected):
    """Waiting prompt tokens that fill a chunk start the prefill at once, whatever the wait."""
    path, prompts, lengths, want = expected
    with Engine(path, FP32_CPU + ["scheduler.overlap=false", "scheduler.prefill_wait_steps=50",
                                  "scheduler.chunked_prefill_size=8"]) as eng:
        outs, _ = drive(eng, prompts, lengths)
        assert outs == want
