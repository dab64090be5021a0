"""Grammar masks (runtime/grammar.py, grammar_steps.py): the vectorised mask equals xgrammar's own
kernel; masks prefilled on the helper thread equal fresh per-matcher fills, across batch changes
and rollbacks; the compiler's cache and background compile; parked requests (GrammarIntake)."""

from __future__ import annotations

import json

import pytest
import torch

xgr = pytest.importorskip("xgrammar")

from moeserve.core import ForwardMode, Req, SamplingParams  # noqa: E402
from moeserve.runtime.grammar import GrammarCompiler, GrammarMatch, apply_token_mask  # noqa: E402
from moeserve.runtime.grammar_steps import GrammarSteps  # noqa: E402
from moeserve.runtime.step import ForwardInput  # noqa: E402
from moeserve.scheduler.grammar_intake import PARKED, GrammarIntake  # noqa: E402

ITEM = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                         "n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["name", "n"]}
SPECS = [("json_schema", json.dumps(ITEM)), ("regex", "(yes|no), [a-z]{2,8}"),
         ("ebnf", 'root ::= ("cat" | "dog") " " [0-9]+'), ("json_object", "")]


@pytest.fixture(scope="module")
def compiler():
    from transformers import AutoTokenizer

    from moeserve.models.embedded import embedded_model_path

    tok = AutoTokenizer.from_pretrained(embedded_model_path())
    return GrammarCompiler(tok, len(tok))


@pytest.mark.parametrize("batch,vocab,rows", [(4, 100, [0, 1, 2, 3]), (5, 70, [1, 3]),
                                              (3, 64, [2]), (2, 49152, [0, 1])])
def test_apply_token_mask_equals_xgrammar_kernel(batch, vocab, rows):
    g = torch.Generator().manual_seed(batch * vocab)
    words = (vocab + 31) // 32
    bits = torch.randint(-2**31, 2**31 - 1, (batch, words), dtype=torch.int32, generator=g)
    logits = torch.randn(batch, vocab, generator=g)
    ref = logits.clone()
    xgr.apply_token_bitmask_inplace(ref, bits, vocab_size=vocab, indices=rows)
    raw = logits.clone()
    assert torch.equal(apply_token_mask(logits, bits[rows], rows, vocab, copy=True), ref)
    assert torch.equal(logits, raw)  # copy: the raw logits are untouched
    assert torch.equal(apply_token_mask(logits, bits[rows], rows, vocab, copy=False), ref)
    assert torch.equal(logits, ref)  # in place


def _fresh_mask(m: GrammarMatch) -> torch.Tensor:
    out = xgr.allocate_token_bitmask(1, m.vocab_size)
    m.matcher.fill_next_token_bitmask(out, 0)
    return out[0]


def _step(matches: list, generated: list[int]) -> ForwardInput:
    """A step sampling each request's token after generated[i] ones (prompt length 10: the
    input token is the last of 10 + generated[i] known ones)."""
    n = len(matches)
    return ForwardInput(ForwardMode.DECODE, list(range(n)), [9 + g for g in generated], [1] * n,
                        torch.zeros(n, dtype=torch.int64), None, [SamplingParams()] * n,
                        [None] * n, [-1] * n, prompt_lens=[10] * n, grammars=list(matches))


def test_prefilled_masks_equal_fresh_fills(compiler):
    """Decode with random allowed tokens while requests join, leave and get rolled back: every
    step's bitmask rows (prefilled on the helper thread or filled at once) equal a plain
    GrammarMatcher fill, and the matchers accept exactly the sampled tokens."""
    g = torch.Generator().manual_seed(0)
    steps = GrammarSteps(torch.device("cpu"))
    live = [GrammarMatch(compiler.compile(s), []) for s in SPECS]
    gen = [0] * len(live)
    for t in range(24):
        if t == 5:  # a request joins
            live.append(GrammarMatch(compiler.compile(SPECS[0]), []))
            gen.append(0)
        if t == 9:  # one leaves, the order changes
            live, gen = live[2:] + live[:1], gen[2:] + gen[:1]
        if t == 13 and gen[0] >= 2:  # a dropped step: two tokens rolled back
            gen[0] -= 2
        mask = steps.mask(_step(live, gen))
        assert mask is not None
        for k, i in enumerate(mask.rows):
            assert torch.equal(mask.bits[k], _fresh_mask(live[i])), (t, i)
        logits = steps.apply(torch.randn(len(live), mask.vocab, generator=g), mask, copy=False)
        tokens = torch.multinomial(torch.softmax(logits, -1), 1, generator=g)[:, 0].tolist()
        steps.after_step(mask, tokens).result()
        for i in mask.rows:
            gen[i] += 1
        keep = [i for i, m in enumerate(live) if not m.matcher.is_terminated()]
        live, gen = [live[i] for i in keep], [gen[i] for i in keep]
        if not live:
            break
    steps.wait()
    assert steps.stats["prefilled_rows"] > 0
    steps.shutdown()


def test_compiler_caches_and_compiles_in_background(compiler):
    spec = ("regex", "[a-c]{3}x")
    assert compiler.cached(spec) is None
    compiled = compiler.compile_async(spec).result()
    assert compiler.cached(spec) is compiled
    with pytest.raises(ValueError, match="invalid json_schema|not valid JSON"):
        compiler.compile_async(("json_schema", "{nope")).result()


def test_intake_parks_until_compiled_and_reports_errors(compiler):
    intake = GrammarIntake(compiler, {2})

    def req(spec) -> Req:
        return Req(f"r{spec}", [1, 2, 3], SamplingParams(grammar=spec))

    cached = req(SPECS[1])
    compiler.compile(SPECS[1])
    assert intake.attach(cached) is None and cached.grammar is not None
    new, bad = req(("regex", "[x-z]{4}")), req(("json_schema", '{"type": "bogus"}'))
    assert intake.attach(new) == PARKED and intake.attach(bad) == PARKED
    assert new.grammar is None
    done: dict = {}
    while len(done) < 2:
        done.update({r.rid: e for r, e in intake.ready(1.0)})
    assert done[new.rid] is None and new.grammar is not None
    assert "bogus" in done[bad.rid]
    assert GrammarIntake(None, set()).attach(req(SPECS[0])).startswith("this scheduler")


@pytest.mark.parametrize("regex", ["H\x00?b", "a\\\x00b", "[\x00-\x02]x", "\\\\\x00", "(\x00|z)+",
                                   "no nul here", "\\x00\x00", "a\\x00b", "\\x41B", "[\\x41-\\x43]B",
                                   "\\\\x41"])
def test_regex_as_re_reads_it(regex):
    """A regex means what Python's re makes of it (the API document's `format: regex`).
    xgrammar refuses a raw NUL and reads `\\x` with every hex digit after it; xgrammar_regex
    rewrites both: Python's re and xgrammar's own matcher then accept the same strings as re
    does with the original."""
    import re

    from xgrammar.testing import _is_grammar_accept_string

    from moeserve.runtime.grammar import xgrammar_regex

    written = xgrammar_regex(regex)
    assert "\x00" not in written
    grammar = xgr.Grammar.from_regex(written)
    samples = ["H\x00b", "Hb", "H0b", "a\x00b", "ab", "\x00x", "\x01x", "\x03x", "\\\x00", "\\",
               "\x00z\x00", "zz", "no nul here", "\x00\x00", "x00\x00", "a\x0bb", "AB", "\u041b",
               "CB", "DB", "\\x41", "\\A", "\x04"]
    for s in samples:
        want = re.fullmatch(regex, s) is not None
        assert (re.fullmatch(written, s) is not None) == want, (regex, s)
        assert _is_grammar_accept_string(grammar, s) == want, (regex, written, s)
