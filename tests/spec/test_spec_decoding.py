"""MTP speculative decoding is lossless: with spec.algorithm=nextn the Engine's outputs equal the
same Engine's without speculation (the oracle), greedy token for token and sampled in distribution.

Two drafts: the tiny DeepSeek-V3's own MTP layer (random weights: its drafts are mostly rejected),
and an oracle draft that proposes the reference continuation with some tokens corrupted, so that
blocks of every accepted length occur — with stop tokens, stop strings and max_new_tokens landing
inside them.
"""

from __future__ import annotations

import random

import pytest
from parity import FP32_CPU, ID_VOCAB

from moeserve import Engine
from spec_oracle import (assert_same_distribution, install_mode_draft, install_oracle_draft,
                         oracle_workload)

GREEDY = {"temperature": 0, "ignore_eos": True}
SPEC = ["spec.algorithm=nextn", "spec.max_batch_size=0"]


def workload(n: int, vocab: int, seed: int = 0) -> tuple[list[list[int]], list[dict]]:
    """Prompts sharing prefixes (radix hits) with varied prompt and output lengths."""
    rng = random.Random(seed)
    system = [rng.randrange(3, vocab) for _ in range(20)]
    prompts, params = [], []
    for i in range(n):
        own = [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 30))]
        prompts.append((system if i % 2 else system[:5]) + own)
        params.append({**GREEDY, "max_new_tokens": rng.randrange(1, 20)})
    return prompts, params


@pytest.fixture(scope="module")
def dsv3(tiny_model):
    path = tiny_model("deepseek_v3", vocab_size=ID_VOCAB)
    with Engine(path, FP32_CPU) as eng:
        vocab = eng.runner.hf_config.vocab_size
        prompts, params = workload(12, vocab)
        expected = [o["output_ids"] for o in eng.generate(input_ids=prompts,
                                                          sampling_params=params)]
    return path, prompts, params, expected


@pytest.mark.parametrize("overrides", [
    ["scheduler.overlap=false", "spec.num_steps=1"],
    ["scheduler.overlap=true", "spec.num_steps=3"],
    ["scheduler.overlap=true", "spec.num_steps=2", "scheduler.chunked_prefill_size=8"],
], ids=["normal-n1", "overlap-n3", "overlap-chunked-n2"])
def test_mtp_layer_greedy_equals_plain(dsv3, overrides):
    path, prompts, params, expected = dsv3
    with Engine(path, FP32_CPU + SPEC + overrides) as eng:
        assert eng.runner.draft.kind == "mtp"
        for _ in range(2):  # the second run is served mostly from the prefix cache
            outs = eng.generate(input_ids=prompts, sampling_params=params)
            assert [o["output_ids"] for o in outs] == expected
        verified = [o["meta"] for o in outs if o["meta"]["completion_tokens"] > 1]
        assert verified and all(m["spec_verify_steps"] >= 1 for m in verified)
        assert eng.scheduler.is_memory_clean()


@pytest.fixture(scope="module")
def oracle_case(dsv3):
    """Long outputs with stop ids, stop strings-free max_new_tokens of every residue mod 4, and
    the plain outputs for them."""
    path, prompts, _, _ = dsv3
    with Engine(path, FP32_CPU) as eng:
        reference, params, plain = oracle_workload(eng, prompts, random.Random(1))
    expected = [o["output_ids"] for o in plain]
    logprobs = [o["meta"]["output_logprobs"] for o in plain]
    return path, prompts, params, reference, expected, logprobs


@pytest.mark.parametrize("corrupt,overlap", [(0.0, False), (0.25, True), (0.6, False),
                                             (1.0, False)])
def test_accepted_blocks_equal_plain(oracle_case, corrupt, overlap):
    path, prompts, params, reference, expected, logprobs = oracle_case
    overrides = FP32_CPU + SPEC + ["spec.num_steps=3", f"scheduler.overlap={str(overlap).lower()}"]
    with Engine(path, overrides) as eng:
        install_oracle_draft(eng, reference, corrupt, seed=7)
        baseline = eng.runner.memory.allocator.available_size()
        outs = eng.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
        assert [o["output_ids"] for o in outs] == expected
        # the verify pass's logprobs are the plain decode step's (a stale K/V would show here)
        for o, want in zip(outs, logprobs):
            assert o["meta"]["output_logprobs"] == pytest.approx(want, abs=1e-4)
        lengths = [o["meta"]["spec_accept_length"] for o in outs
                   if o["meta"].get("spec_verify_steps", 0) >= 2]
        for o in outs:  # every token after the prefill's comes from a verify step, counted once
            m = o["meta"]  # (a block cut by max_new_tokens or a stop counts its kept tokens)
            assert m.get("spec_accepted_tokens", 0) == m["completion_tokens"] - 1
        mean = sum(lengths) / len(lengths)
        if corrupt == 0.0:
            assert mean > 3.0  # nearly every block is fully accepted (4 tokens per pass)
        elif corrupt == 1.0:
            assert mean == 1.0  # every draft rejected: each verify pass yields one token
        else:
            assert 1.0 < mean < 4.0
        assert eng.scheduler.is_memory_clean()
        eng.scheduler.cache.flush()
        assert eng.runner.memory.allocator.available_size() == eng.runner.memory.allocator.size
        assert baseline <= eng.runner.memory.allocator.size


def test_sampling_distribution_matches_plain(tiny_model):
    """Rejection sampling is exact: over many seeded requests the first three sampled tokens are
    distributed as without speculation (chi-squared test of homogeneity per position, p > 1e-3),
    for temperature 0.7 with top_p 0.9, on a 24-token vocabulary. Drafts are the plain run's
    most frequent tokens, so a wrong acceptance rule shifts their share visibly."""
    path = tiny_model("deepseek_v3", vocab_size=24, initializer_range=0.3)  # peaked logits
    prompt = [[5, 9, 3, 17, 11]]
    sp = {"temperature": 0.7, "top_p": 0.9, "max_new_tokens": 3, "ignore_eos": True}
    samples, modes = {}, []
    for name, extra in (("plain", []), ("spec", SPEC + ["spec.num_steps=2"])):
        with Engine(path, FP32_CPU + extra + ["cache.max_running_requests=256"]) as eng:
            if name == "spec":
                install_mode_draft(eng, modes)
            params = [{**sp, "seed": 1000 * (name == "spec") + i} for i in range(1500)]
            outs = eng.generate(input_ids=prompt * len(params), sampling_params=params)
            samples[name] = [o["output_ids"] for o in outs]
            if name == "plain":
                modes = [max(set(col), key=col.count) for col in zip(*samples[name])]
            else:
                # two tokens after the prefill's: one verify step when its first draft is
                # accepted, two when not; both outcomes must be frequent
                steps = [o["meta"]["spec_verify_steps"] for o in outs]
                assert set(steps) == {1, 2}
                assert 0.1 * len(steps) < steps.count(1) < 0.95 * len(steps)
    assert_same_distribution(samples)


def test_plain_steps_above_max_batch_size_and_for_edited_logits(dsv3):
    """Batches above spec.max_batch_size, and requests with penalties, step aside (plain decode
    steps with a one-token draft extend) and still give the plain outputs."""
    path, prompts, params, expected = dsv3
    with Engine(path, FP32_CPU + SPEC + ["spec.max_batch_size=4"]) as eng:
        outs = eng.generate(input_ids=prompts, sampling_params=params)
        assert [o["output_ids"] for o in outs] == expected
        assert eng.scheduler.is_memory_clean()
    penalised = [{**p, "repetition_penalty": 1.3} for p in params]
    with Engine(path, FP32_CPU) as eng:
        want = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=penalised)]
    with Engine(path, FP32_CPU + SPEC) as eng:
        outs = eng.generate(input_ids=prompts, sampling_params=penalised)
        assert [o["output_ids"] for o in outs] == want
        assert all("spec_verify_steps" not in o["meta"] for o in outs)


def test_small_batches_step_aside_below_min_batch_size(dsv3):
    """spec.min_batch_size: a decode batch below it runs plain steps (a MoE target's choice), one
    at or above it verifies; outputs are plain decoding's either way, and a negative size is a
    config error naming the key."""
    from moeserve.config import ConfigError, compose

    path, prompts, params, expected = dsv3
    with Engine(path, FP32_CPU + SPEC + [f"spec.min_batch_size={len(prompts) + 1}"]) as eng:
        outs = eng.generate(input_ids=prompts, sampling_params=params)
        assert [o["output_ids"] for o in outs] == expected
        assert all(o["meta"].get("spec_verify_steps", 0) == 0 for o in outs)
    with Engine(path, FP32_CPU + SPEC + ["spec.min_batch_size=2"]) as eng:
        outs = eng.generate(input_ids=prompts, sampling_params=params)
        assert [o["output_ids"] for o in outs] == expected
        assert sum(o["meta"].get("spec_verify_steps", 0) for o in outs) > 0
        one = eng.generate(input_ids=prompts[:1], sampling_params=params[:1])  # batch 1: plain
        assert one[0]["output_ids"] == expected[0]
        assert one[0]["meta"].get("spec_verify_steps", 0) == 0
        assert eng.scheduler.is_memory_clean()
    with pytest.raises(ConfigError, match="spec.min_batch_size"):
        compose(["spec.algorithm=nextn", "spec.min_batch_size=-1"])


def test_cpu_default_steps_aside_above_the_measured_batch_size(dsv3):
    """spec.max_batch_size left null takes the device's measured size (SPEC_STEP_ASIDE): on a
    CPU a decode batch within it verifies drafts, a larger one runs plain steps; both give the
    plain outputs."""
    from moeserve.config import SPEC_STEP_ASIDE

    path, prompts, params, expected = dsv3
    limit = SPEC_STEP_ASIDE["cpu"]
    assert 0 < limit < len(prompts)
    same_length = [{**GREEDY, "max_new_tokens": 12}] * len(prompts)  # finish together
    with Engine(path, FP32_CPU) as eng:
        want = [o["output_ids"] for o in eng.generate(input_ids=prompts,
                                                      sampling_params=same_length)]
    with Engine(path, FP32_CPU + ["spec.algorithm=nextn"]) as eng:
        few = eng.generate(input_ids=prompts[:limit], sampling_params=same_length[:limit])
        many = eng.generate(input_ids=prompts, sampling_params=same_length)
        assert eng.scheduler.is_memory_clean()
    assert [o["output_ids"] for o in few] == want[:limit]
    assert [o["output_ids"] for o in many] == want
    assert all(o["meta"].get("spec_verify_steps", 0) > 0 for o in few)
    assert all(o["meta"].get("spec_verify_steps", 0) == 0 for o in many)


def test_config_errors_name_the_key(tiny_model):
    from moeserve.config import ConfigError

    with pytest.raises(ConfigError, match="spec.draft_path"):
        Engine(tiny_model("llama"), FP32_CPU + SPEC)  # no MTP layer and no trained head
    with pytest.raises(ConfigError, match="spec.num_steps"):
        Engine(tiny_model("deepseek_v3"), FP32_CPU + SPEC + ["spec.num_steps=0"])


def test_rejected_round_leaves_no_stale_kv(dsv3):
    """A round rejecting everything, then one accepting: the second one's queries past its first
    attend over positions whose drafts the first rejected — they must see the new tokens' K/V
    (a batch of one request keeps the same rows and lengths, so cached K/V would be reused)."""
    path, prompts, _, _ = dsv3
    sp = {**GREEDY, "max_new_tokens": 16}
    with Engine(path, FP32_CPU) as eng:
        plain = eng.generate(input_ids=prompts[:1], sampling_params=sp, return_logprob=True)[0]
    with Engine(path, FP32_CPU + SPEC + ["spec.num_steps=3"]) as eng:
        install_oracle_draft(eng, {tuple(prompts[0]): plain["output_ids"]}, 0.0, 0,
                             alternate=True)
        out = eng.generate(input_ids=prompts[:1], sampling_params=sp, return_logprob=True)[0]
    assert out["output_ids"] == plain["output_ids"]
    assert out["meta"]["output_logprobs"] == pytest.approx(plain["meta"]["output_logprobs"],
                                                           abs=1e-4)
    assert 1.5 < out["meta"]["spec_accept_length"] < 4
