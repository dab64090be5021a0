"""Prefill admission under staggered arrivals (one new request per scheduler step, as a busy server
sees them): MIXED steps and scheduler.prefill_wait_steps keep greedy outputs equal to one request at
a time, and the wait serves several arrivals per prefill step."""

from __future__ import annotations

import random

import pytest
from parity import FP32_CPU, ID_VOCAB

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
    path = tiny_model("qwen3", vocab_size=ID_VOCAB)
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


def test_admission_charges_the_cached_prefixes_it_locks(expected):
    """Requests that share a cached prefix lock it when admitted, so it can no longer be evicted
    for their new tokens. A budget that still counted it let a batch in that `alloc_slots` could
    not serve; the batch was undone and rebuilt the same every step, and the rank ran nothing
    with an empty pool (the DP soak's deadlock). Every step must now run a batch, and the outputs
    equal one request at a time."""
    path, prompts, lengths, want = expected
    rng = random.Random(7)
    shared = [rng.randrange(100, 5000) for _ in range(40)]
    tails = [[rng.randrange(100, 5000) for _ in range(12)] for _ in range(4)]
    fresh = [rng.randrange(100, 5000) for _ in range(30)]
    greedy = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 2}
    batch_prompts = [shared + t for t in tails] + [fresh]
    with Engine(path, FP32_CPU + ["scheduler.disable_radix_cache=true"]) as eng:
        alone = [eng.generate(input_ids=[p], sampling_params=greedy)[0]["output_ids"]
                 for p in batch_prompts]
    # 100 slots: `shared` (40) stays cached, 60 are free; the batch needs 4 x 12 + 30 = 78 new
    with Engine(path, FP32_CPU + ["scheduler.overlap=false", "cache.max_total_tokens=100"]) as eng:
        eng.generate(input_ids=[shared + [7]], sampling_params={**greedy, "max_new_tokens": 1})
        sched = eng.scheduler
        assert sched.cache.tree.evictable_size() >= 40 and sched.cache.available() == 100
        for i, p in enumerate(batch_prompts):
            sched.add_request(GenerateReq(rid=f"b{i}", input_ids=p,
                                          sampling=SamplingParams.from_dict(greedy)))
        steps = 0
        while sched.has_work():
            batch, _ = sched.next_synced_batch(False)
            assert batch is not None, (
                f"step {steps}: {len(sched.waiting)} waiting, {len(sched.running)} running and "
                f"no batch (free {sched.runner.memory.allocator.available_size()}, evictable "
                f"{sched.cache.tree.evictable_size()})")
            sched.process_result(batch, sched.worker.submit(batch.forward_input).result())
            steps += 1
            assert steps < 50
        outs = [[t for o in sched.io.outputs[f"b{i}"] for t in o.new_ids]
                for i in range(len(batch_prompts))]
        assert outs == alone
        sched.cache.free_deferred_rows()
        assert sched.is_memory_clean()
