"""bench.grammar_mask on a tiny budget: xgrammar accepts the 20 schemas' token sequences to the end
with B matchers in lockstep; where llguidance is installed, it does too, and the two engines (two
independent implementations) allow the same tokens at every step of every sequence, up to the
documented classes of difference (mask_differences: forced-text tokenization, raw control bytes
and special tokens in strings, escapes in length-bounded strings)."""

from __future__ import annotations

import importlib.util

import pytest

pytest.importorskip("xgrammar")

from moeserve.bench import grammar_mask as gm  # noqa: E402
from moeserve.bench.grammar_schemas import schemas  # noqa: E402


@pytest.fixture(scope="module")
def setup():
    tok = gm.load_tokenizer("smollm2")
    specs = schemas()
    return tok, len(tok), specs, gm.sequences(tok, specs)


@pytest.fixture(scope="module")
def engines(setup):
    """xgrammar, and llguidance when it is installed (its tokenizer takes ~3 s: built once)."""
    tok, vocab = setup[:2]
    out = [gm.Xgrammar(tok, vocab)]
    if importlib.util.find_spec("llguidance") is not None:
        out.append(gm.Llguidance(tok, vocab))
    return out


def test_sequences_are_schema_instances(setup):
    jsonschema = pytest.importorskip("jsonschema")
    tok, _, specs, seqs = setup
    for spec, seq in zip(specs, seqs):
        assert seq[-1] == tok.eos_token_id
        jsonschema.validate(__import__("json").loads(tok.decode(seq[:-1])), spec)


@pytest.mark.parametrize("batch", [1, 24])
def test_lockstep_steps_complete(setup, engines, batch):
    """Every row's tokens are accepted; rows restart when done; the bitmask each step allows the
    token the row accepts next, and the timings are filled in."""
    tok, vocab, specs, seqs = setup
    for engine in engines:
        compiled = [engine.compile(s, cold=False) for s in specs]

        def check(bits, tokens):
            ok = gm.allowed(bits, vocab)
            assert all(ok[i, t] for i, t in enumerate(tokens)), engine.name

        r = gm.run_steps(engine, compiled, seqs, batch, 60, 5, vocab, on_step=check)
        assert r["completed"] >= batch and 0 < r["fill_mean"] <= r["fill_p99"] * 1.0001


def test_engines_masks_agree(setup, engines):
    """Per step of every sequence, xgrammar's and llguidance's allowed sets differ only in the
    explained classes; some steps do differ (the check is not vacuous) and most agree exactly."""
    if len(engines) < 2:
        pytest.skip("llguidance is not installed")
    x, ll = engines
    steps, differing = 0, set()
    for k, (spec, seq) in enumerate(zip(setup[2], setup[3])):
        diff = gm.mask_differences(x, ll, spec, seq)
        assert diff["other"] == [], (k, diff)
        differing |= {(k, s) for v in diff.values() for s in v}
        steps += len(seq)
    assert 0 < len(differing) < steps


def test_strict_adds_no_extra_properties():
    s = schemas()[4]
    out = gm.strict(s)
    assert out["additionalProperties"] is False
    assert out["properties"]["items"]["items"]["additionalProperties"] is False
    assert "additionalProperties" not in s
