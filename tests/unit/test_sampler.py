"""Sampling filters against transformers' logits warpers; seeds; greedy."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (MinPLogitsWarper, TopKLogitsWarper,
                                                    TopPLogitsWarper)

from moeserve.core import SamplingParams
from moeserve.runtime.sampler import filter_probs, make_generator, sample


# (-1, 1.0, 0.0), (-1, 1.0, 0.1) and (200, 1.0, 0.05) (top-k of the whole vocabulary) take the
# path that does not sort
@pytest.mark.parametrize("top_k,top_p,min_p", [(5, 1.0, 0.0), (-1, 0.9, 0.0), (-1, 1.0, 0.1),
                                               (20, 0.8, 0.05), (1, 1.0, 0.0), (-1, 1.0, 0.0),
                                               (200, 1.0, 0.05)])
def test_filter_support_matches_transformers(top_k, top_p, min_p):
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        logits = torch.randn(1, 200, generator=g) * 3
        scores = logits.clone()
        if top_k > 0:
            scores = TopKLogitsWarper(top_k)(None, scores)
        if top_p < 1.0:
            scores = TopPLogitsWarper(top_p)(None, scores)
        if min_p > 0.0:
            scores = MinPLogitsWarper(min_p)(None, scores)
        expected = torch.softmax(scores, -1)[0]
        ours = filter_probs(torch.softmax(logits, -1)[0], top_k, top_p, min_p)
        assert torch.equal(ours > 0, expected > 0)
        assert torch.allclose(ours, expected, atol=1e-6)


def test_greedy_is_argmax_and_seed_reproducible():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    greedy = SamplingParams(temperature=0)
    seeded = SamplingParams(temperature=1.0, seed=7)
    params = [greedy, seeded, seeded]
    gens = [make_generator(p, torch.device("cpu")) for p in params]
    out = sample(logits.clone(), params, gens)
    assert out[0] == logits[0].argmax()
    again = sample(logits[1:2].clone(), [seeded], [make_generator(seeded, torch.device("cpu"))])
    assert out[1] == again[0]
    # the runner hands model-dtype logits to the sampler: sampled rows upcast them first
    half = logits.bfloat16()
    a = sample(half.clone(), params, [make_generator(p, torch.device("cpu")) for p in params])
    b = sample(half.float(), params, [make_generator(p, torch.device("cpu")) for p in params])
    assert a.tolist() == b.tolist()


def test_seeded_sampling_follows_distribution():
    probs = torch.tensor([0.5, 0.3, 0.2])
    params = SamplingParams(temperature=1.0, seed=3)
    gen = make_generator(params, torch.device("cpu"))
    counts = torch.zeros(3)
    for _ in range(3000):
        counts[sample(probs.log()[None].clone(), [params], [gen])[0]] += 1
    assert torch.allclose(counts / 3000, probs, atol=0.04)


def test_invalid_params_are_refused():
    for bad in [{"temperature": -1}, {"top_p": 0}, {"top_k": 0}, {"max_new_tokens": -2},
                {"min_p": 2}, {"nonsense": 1}]:
        with pytest.raises(ValueError):
            SamplingParams.from_dict(bad)


@pytest.mark.parametrize("vocab", [7, 2048, 4096, 129280, 49153])
def test_greedy_equals_torch_argmax_with_ties_and_nan(vocab):
    from moeserve.runtime.sampler import greedy

    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(14, vocab, generator=g)
    logits[1] = 0.0  # all tied: the first index
    logits[2, -1] = logits[2].max() + 1  # the max in the last (partial) chunk
    logits[3, [5, vocab - 1]] = 50.0  # tie across chunks
    logits[4, vocab // 2] = float("nan")
    logits[5] = float("-inf")
    logits[6, 0] = float("inf")
    logits[7] = -logits[7].abs() - 1  # every value negative
    logits[8] = -logits[8].abs()
    logits[8, vocab // 3] = 0.0  # the max is +0 ...
    logits[8, vocab // 4] = -0.0  # ... tied with an earlier -0
    logits[9, 3] = -float("nan")  # a negative NaN among positive values
    logits[10, [1, vocab - 2]] = float("nan")
    logits[11] = logits[11].abs() * 1e-39  # subnormal positives (bf16 keeps them)
    logits[12, :] = float("inf")
    logits[12, vocab // 2] = -float("inf")  # sum NaN without a NaN
    logits[13, vocab - 1] = float("-inf")
    for dtype in (torch.float32, torch.bfloat16):
        x = logits.to(dtype)
        assert greedy(x).tolist() == x.argmax(-1).tolist(), dtype
        assert greedy(x).tolist() == x.float().argmax(-1).tolist(), dtype  # the runner's upcast


@pytest.mark.parametrize("temperature", [5e-324, 1e-45, 1e-30])
def test_vanishing_temperature_samples_the_argmax(temperature):
    """logits / T overflowing to inf made softmax NaN and multinomial raise, which killed the
    scheduler (one request with temperature 5e-324 took the server down): the T -> 0 limit is the
    argmax."""
    logits = torch.tensor([[0.5, 3.0, -1.0, 2.9], [1.0, 1.0, 7.0, -2.0]])
    params = [SamplingParams(temperature=temperature, seed=1)] * 2
    gens = [make_generator(p, logits.device) for p in params]
    assert sample(logits, params, gens).tolist() == [1, 2]
    assert sample(torch.tensor([[float("inf"), 0.0, float("-inf")]]), params[:1],
                  gens[:1]).tolist() == [0]
