"""Penalties and logit_bias against transformers' logits processors and OpenAI's arithmetic, on the
same logits and token histories read from a token table."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (RepetitionPenaltyLogitsProcessor,
                                                    SequenceBiasLogitsProcessor)

from moeserve.core import SamplingParams
from moeserve.runtime.penalties import LogitEdits, edit_logits

V = 64


def openai_penalties(logits: torch.Tensor, generated: list[int], freq: float, pres: float):
    """OpenAI's documented formula, token by token: mu[j] -= c[j] * freq + (c[j] > 0) * pres."""
    out = logits.clone()
    for j in set(generated):
        c = generated.count(j)
        out[j] -= c * freq + (1.0 if c > 0 else 0.0) * pres
    return out


def case(seed: int, batch: int):
    """Random logits, histories (prompt + generated) in table rows, and per-row params."""
    g = torch.Generator().manual_seed(seed)
    table = torch.randint(0, V, (8, 40), generator=g)
    rows = torch.randperm(8, generator=g)[:batch]
    prompt = torch.randint(1, 12, (batch,), generator=g)
    known = prompt + torch.randint(0, 20, (batch,), generator=g)
    logits = torch.randn(batch, V, generator=g) * 4
    params = [SamplingParams(frequency_penalty=float(torch.rand(1, generator=g)) * 2 - 0.5,
                             presence_penalty=float(torch.rand(1, generator=g)) * 2 - 1,
                             repetition_penalty=0.5 + float(torch.rand(1, generator=g)) * 1.5,
                             logit_bias={int(t): 10.0 * (k - 1) for k, t in
                                         enumerate(torch.randint(0, V, (3,), generator=g))})
              for _ in range(batch)]
    return table, rows, prompt, known, logits, params


@pytest.mark.parametrize("seed", range(5))
def test_matches_transformers_and_openai_arithmetic(seed):
    table, rows, prompt, known, logits, params = case(seed, batch=5)
    params[1] = SamplingParams()  # a row without edits keeps its logits
    params[2] = SamplingParams(logit_bias={3: -100.0})  # bias only
    ours = edit_logits(logits, LogitEdits.build(params), table, rows, prompt, known)
    for b, p in enumerate(params):
        history = table[rows[b], : known[b]]
        generated = history[prompt[b]:].tolist()
        expected = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(
            history[None], logits[b : b + 1].clone()) if p.repetition_penalty != 1.0 else \
            logits[b : b + 1].clone()
        expected = openai_penalties(expected[0], generated, p.frequency_penalty,
                                    p.presence_penalty)[None]
        if p.logit_bias:
            bias = {(t,): v for t, v in p.logit_bias}
            expected = SequenceBiasLogitsProcessor(bias)(history[None], expected)
        torch.testing.assert_close(ours[b : b + 1], expected, rtol=1e-5, atol=1e-5)


def test_no_edits_is_none_and_greedy_path_kept():
    assert LogitEdits.build([SamplingParams(), SamplingParams(temperature=0)]) is None
    assert SamplingParams(temperature=0, logit_bias={1: 1.0}).edits_logits


@pytest.mark.parametrize("kw", [{"frequency_penalty": 2.5}, {"presence_penalty": -3},
                                {"repetition_penalty": 0.0}, {"logit_bias": {1: 101}}])
def test_out_of_range_is_refused(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        SamplingParams(**kw)


def test_bf16_logits_edited_in_float32():
    table, rows, prompt, known, logits, params = case(7, batch=3)
    out = edit_logits(logits.bfloat16(), LogitEdits.build(params), table, rows, prompt, known)
    ref = edit_logits(logits.bfloat16().float(), LogitEdits.build(params), table, rows, prompt,
                      known)
    assert out.dtype == torch.float32 and torch.equal(out, ref)
