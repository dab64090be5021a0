"""Continuous batching on the real Scheduler (through the offline Engine): cache hits, chunked
prefill, normal vs overlap loops, retraction under KV pressure — all against sequential greedy runs."""

from __future__ import annotations

import random

import pytest
from parity import FP32_CPU, ID_VOCAB

from moeserve import Engine

GREEDY = {"temperature": 0, "ignore_eos": True}


def workload(n: int, seed: int = 0) -> tuple[list[list[int]], list[dict]]:
    """Prompts with shared prefixes and varied lengths; varied output lengths."""
    rng = random.Random(seed)
    system = [rng.randrange(100, 5000) for _ in range(24)]
    prompts, params = [], []
    for i in range(n):
        own = [rng.randrange(100, 5000) for _ in range(rng.randrange(1, 40))]
        prompts.append((system if i % 2 == 0 else system[:7]) + own)
        params.append({**GREEDY, "max_new_tokens": rng.randrange(1, 24)})
    return prompts, params


@pytest.fixture(scope="module")
def sequential(tiny_model):
    """Reference: one request at a time, no prefix cache, no overlap."""
    path = tiny_model("qwen3", vocab_size=ID_VOCAB)
    prompts, params = workload(24)
    with Engine(path, FP32_CPU + ["scheduler.overlap=false",
                                  "scheduler.disable_radix_cache=true"]) as eng:
        outs = [eng.generate(input_ids=[p], sampling_params=sp)[0]["output_ids"]
                for p, sp in zip(prompts, params)]
    return path, prompts, params, outs


@pytest.mark.parametrize("overrides", [
    ["scheduler.overlap=false"],
    ["scheduler.overlap=true"],
    ["scheduler.overlap=true", "scheduler.chunked_prefill_size=16"],
    ["scheduler.overlap=false", "scheduler.chunked_prefill_size=8", "cache.page_size=4"],
    ["scheduler.overlap=true", "scheduler.disable_radix_cache=true", "scheduler.policy=fcfs"],
    ["scheduler.overlap=true", "scheduler.mixed_chunk=true", "scheduler.chunked_prefill_size=24"],
    ["scheduler.overlap=false", "scheduler.mixed_chunk=true", "scheduler.chunked_prefill_size=8",
     "cache.page_size=4"],
], ids=["normal", "overlap", "overlap-chunked", "normal-chunked-page4", "overlap-nocache-fcfs",
        "overlap-mixed", "normal-mixed-page4"])
def test_batched_equals_sequential(sequential, overrides):
    path, prompts, params, expected = sequential
    with Engine(path, FP32_CPU + overrides) as eng:
        outs = eng.generate(input_ids=prompts, sampling_params=params)
        assert [o["output_ids"] for o in outs] == expected
        if "scheduler.mixed_chunk=true" in overrides:  # decodes rode along with prefill chunks
            assert eng.scheduler.stats["mixed_steps"] > 0
        again = eng.generate(input_ids=prompts, sampling_params=params)  # now mostly cache hits
        assert [o["output_ids"] for o in again] == expected
        if "scheduler.disable_radix_cache=true" not in overrides:
            assert sum(o["meta"]["cached_tokens"] for o in again) > sum(map(len, prompts)) // 2
        assert eng.scheduler.is_memory_clean()


@pytest.fixture(scope="module")
def pressure_workload(tiny_model):
    """64 prompts and their outputs run one at a time (computed once for every loop variant)."""
    path = tiny_model("llama", vocab_size=ID_VOCAB)
    rng = random.Random(1)
    prompts = [[rng.randrange(100, 5000) for _ in range(rng.randrange(4, 20))] for _ in range(64)]
    params = {**GREEDY, "max_new_tokens": 24}
    with Engine(path, FP32_CPU + ["scheduler.overlap=false"]) as eng:
        expected = [eng.generate(input_ids=[p], sampling_params=params)[0]["output_ids"]
                    for p in prompts]
    return path, prompts, params, expected


@pytest.mark.parametrize("overlap,mixed", [(False, False), (True, False), (True, True)])
def test_retraction_under_kv_pressure(pressure_workload, overlap, mixed):
    """64 concurrent requests in a pool that holds a fraction of them: every request completes,
    outputs equal sequential runs, and the pool returns to its baseline."""
    path, prompts, params, expected = pressure_workload
    small = FP32_CPU + [f"scheduler.overlap={str(overlap).lower()}", "cache.max_total_tokens=400",
                        f"scheduler.mixed_chunk={str(mixed).lower()}",
                        "scheduler.init_new_token_ratio=0.05", "scheduler.min_new_token_ratio=0.01"]
    with Engine(path, small) as eng:
        baseline = eng.scheduler.cache.available()
        outs = eng.generate(input_ids=prompts, sampling_params=params)
        assert eng.scheduler.stats["retractions"] > 0
        assert [o["output_ids"] for o in outs] == expected
        assert eng.scheduler.is_memory_clean()
        assert eng.scheduler.cache.available() == baseline


def test_stop_conditions(tiny_model):
    path = tiny_model("llama")
    with Engine(path, FP32_CPU) as eng:
        prompt = [[11, 22, 33, 44]]
        free = eng.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 12})[0]
        ids = free["output_ids"]
        stop_tok = eng.generate(input_ids=prompt, sampling_params={
            **GREEDY, "max_new_tokens": 12, "stop_token_ids": [ids[5]]})[0]
        assert stop_tok["output_ids"] == ids[: ids.index(ids[5]) + 1]
        assert stop_tok["meta"]["finish_reason"] == "stop"
        text = free["text"]
        words = text.split()
        assert len(words) >= 2, text  # 12 random-model tokens decode to several words
        stop_str = words[len(words) // 2]
        cut = eng.generate(input_ids=prompt, sampling_params={
            **GREEDY, "max_new_tokens": 12, "stop": [stop_str]})[0]
        assert cut["text"] == text[: text.index(stop_str)]
        assert cut["meta"]["finish_reason"] == "stop"
        zero = eng.generate(input_ids=prompt, sampling_params={"max_new_tokens": 1})[0]
        assert len(zero["output_ids"]) == 1 and zero["meta"]["finish_reason"] == "length"


def test_seeded_sampling_is_reproducible_in_any_batch(tiny_model):
    with Engine(tiny_model("llama"), FP32_CPU) as eng:
        sp = {"temperature": 1.0, "seed": 123, "max_new_tokens": 10, "ignore_eos": True}
        alone = eng.generate(input_ids=[[5, 6, 7]], sampling_params=sp)[0]["output_ids"]
        batch = eng.generate(input_ids=[[9, 9], [5, 6, 7], [1, 2, 3, 4]],
                             sampling_params=[{**sp, "seed": 1}, sp, {**sp, "seed": 2}])
        assert batch[1]["output_ids"] == alone
        assert batch[0]["output_ids"] != alone


def test_too_long_prompt_is_refused(tiny_model):
    with Engine(tiny_model("llama"), FP32_CPU + ["model.context_length=32"]) as eng:
        with pytest.raises(ValueError, match="context length"):
            eng.generate(input_ids=[list(range(100, 130))], sampling_params={"max_new_tokens": 8})
        assert eng.scheduler.is_memory_clean()
