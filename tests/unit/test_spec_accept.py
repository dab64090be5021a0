"""Verification rules against their definitions: greedy acceptance is the longest prefix where the
target's argmax equals the drafts; rejection sampling with a greedy (one-hot) draft emits tokens
distributed exactly as the target's processed distribution (chi-squared goodness of fit)."""

from __future__ import annotations

import itertools

import torch
from scipy.stats import chisquare

from moeserve.core import SamplingParams
from moeserve.runtime.sampler import target_probs
from moeserve.spec_mtp.accept import greedy_accept, rejection_accept


def test_greedy_accept_is_longest_matching_prefix():
    for target in itertools.product(range(3), repeat=4):
        for drafts in itertools.product(range(3), repeat=3):
            j = 0
            while j < 3 and target[j] == drafts[j]:
                j += 1
            got = greedy_accept(torch.tensor([target]), torch.tensor([drafts]))
            assert got.tolist() == [j]


def test_rejection_sampling_emits_the_target_distribution():
    """First emitted token ~ p_0 whatever the draft; with a likely draft the second token, when
    the first was accepted, ~ p_1."""
    base = torch.tensor([0.35, 0.25, 0.15, 0.12, 0.08, 0.05]).log()
    logits = torch.stack([base, base[[2, 0, 1, 4, 3, 5]], base.flip(0)])
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=5)
    p = [target_probs(logits[i], params) for i in range(3)]
    drafts = [int(p[0].argmax()), int(p[1].argmax())]
    gen = torch.Generator().manual_seed(1)
    first, second = [], []
    for _ in range(6000):
        out = rejection_accept(logits, drafts, params, gen)
        first.append(out[0])
        if out[0] == drafts[0]:
            second.append(out[1])
    for samples, probs in ((first, p[0]), (second, p[1])):
        support = [t for t in range(6) if probs[t] > 0]
        counts = [samples.count(t) for t in support]
        assert len(support) >= 3
        assert sum(counts) == len(samples)  # nothing outside top-k / top-p is ever emitted
        expected = [float(probs[t]) for t in support]
        expected = [e / sum(expected) * sum(counts) for e in expected]
        assert chisquare(counts, expected).pvalue > 1e-3


def test_rejection_sampling_with_a_draft_outside_the_support():
    """A restricted draft vocabulary can propose a token the target's processed distribution
    excludes (outside top-k / top-p): it is never accepted and the emitted token ~ p_0."""
    base = torch.tensor([0.4, 0.3, 0.2, 0.06, 0.04]).log()
    params = SamplingParams(temperature=1.0, top_p=0.85)
    p0 = target_probs(base, params)
    outside = int(p0.argmin())
    assert p0[outside] == 0
    gen = torch.Generator().manual_seed(3)
    first = [rejection_accept(torch.stack([base, base]), [outside], params, gen)[0]
             for _ in range(4000)]
    assert outside not in first
    support = [t for t in range(5) if p0[t] > 0]
    counts = [first.count(t) for t in support]
    expected = [float(p0[t]) for t in support]
    expected = [e / sum(expected) * len(first) for e in expected]
    assert chisquare(counts, expected).pvalue > 1e-3
