"""Structured outputs under MTP speculation: verify steps mask every draft position as plain
decoding would (runtime/grammar_steps.verify_mask), so constrained outputs are token-identical to
the same Engine without speculation, with drafts accepted, refused by the grammar, or completing
it inside a block; logprobs stay the raw distribution's; sampled outputs stay inside the grammar.

Drafts come from the oracle (the plain constrained run, some tokens corrupted: a corrupted token is
usually one the grammar refuses) and from the tiny DeepSeek-V3's own random MTP layer."""

from __future__ import annotations

import json

import pytest
from parity import FP32_CPU
from spec_oracle import install_oracle_draft

from moeserve import Engine

xgr = pytest.importorskip("xgrammar")

SPEC = ["spec.algorithm=nextn", "spec.max_batch_size=0", "spec.num_steps=3"]
ITEM = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                         "n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["name", "n"]}
GRAMMARS = [("regex", "(yes|no), [a-z]{2,8}"), ("json_schema", json.dumps(ITEM)),
            ("ebnf", 'root ::= ("cat" | "dog") " " [0-9]+ "."'), ("regex", "[a-z ,.]{300}")]


@pytest.fixture(scope="module")
def case(tiny_model):
    """(path, prompts, params, plain outputs with logprobs): greedy, one grammar per prompt,
    plus an unconstrained request in the same batches."""
    path = tiny_model("deepseek_v3")
    prompts = [[5 + i, 17, 3 * i + 2, 40, 9, 11 + i] for i in range(len(GRAMMARS) + 1)]
    params = [{"temperature": 0, "max_new_tokens": 24, "grammar": g} for g in GRAMMARS]
    params.append({"temperature": 0, "max_new_tokens": 24, "ignore_eos": True})
    with Engine(path, FP32_CPU) as eng:
        outs = eng.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
    return path, prompts, params, outs


def _accepted(compiler, spec: tuple[str, str], ids: list[int], complete: bool) -> bool:
    m = xgr.GrammarMatcher(compiler.compile(spec))
    ok = all(m.accept_token(t) for t in ids)
    return ok and (m.is_terminated() or not complete)


@pytest.mark.parametrize("corrupt,overlap", [(0.0, "true"), (0.3, "false"), (1.0, "true")])
def test_constrained_outputs_equal_plain_with_oracle_drafts(case, corrupt, overlap):
    path, prompts, params, plain = case
    reference = {tuple(p): o["output_ids"] for p, o in zip(prompts, plain)}
    with Engine(path, FP32_CPU + SPEC + [f"scheduler.overlap={overlap}"]) as eng:
        install_oracle_draft(eng, reference, corrupt, seed=3)
        outs = eng.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
        assert eng.scheduler.is_memory_clean()
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in plain]
    assert [o["meta"]["finish_reason"] for o in outs] == [o["meta"]["finish_reason"]
                                                          for o in plain]
    for o, want in zip(outs, plain):  # the raw distribution's, as without speculation
        assert o["meta"]["output_logprobs"] == pytest.approx(want["meta"]["output_logprobs"],
                                                             abs=1e-4)
    constrained = [o["meta"] for o in outs[: len(GRAMMARS)]]
    assert all(m.get("spec_verify_steps", 0) >= 1 for m in constrained)  # they verified
    accepted = sum(m["spec_accepted_tokens"] - m["spec_verify_steps"] for m in constrained)
    if corrupt == 0.0:
        assert accepted > 0  # drafts the grammar allows were accepted
    if corrupt == 1.0:
        assert accepted == 0
    # the case has a grammar that completes within max_new_tokens (its "stop" is compared above)
    assert plain[0]["meta"]["finish_reason"] == "stop"


def test_constrained_outputs_equal_plain_with_the_mtp_layer(case):
    path, prompts, params, plain = case
    with Engine(path, FP32_CPU + SPEC) as eng:
        assert eng.runner.draft.kind == "mtp"
        outs = eng.generate(input_ids=prompts, sampling_params=params)
        assert eng.scheduler.is_memory_clean()
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in plain]


def test_sampled_constrained_outputs_follow_the_grammar(case):
    path, prompts, _, plain = case
    reference = {tuple(p): o["output_ids"] for p, o in zip(prompts, plain)}
    params = [{"temperature": 0.9, "top_p": 0.95, "seed": i, "max_new_tokens": 24, "grammar": g}
              for i, g in enumerate(GRAMMARS)]
    with Engine(path, FP32_CPU + SPEC) as eng:
        install_oracle_draft(eng, reference, 0.2, seed=5)
        outs = eng.generate(input_ids=prompts[: len(GRAMMARS)], sampling_params=params)
        assert eng.scheduler.is_memory_clean()
    from transformers import AutoConfig, AutoTokenizer

    from moeserve.runtime.grammar import GrammarCompiler

    compiler = GrammarCompiler(AutoTokenizer.from_pretrained(path),  # one for the four grammars
                               AutoConfig.from_pretrained(path).vocab_size)
    for o, g in zip(outs, GRAMMARS):
        done = o["meta"]["finish_reason"] == "stop"
        assert _accepted(compiler, g, o["output_ids"], done), (g, o["text"])


def test_draft_tree_batches_with_grammars_take_plain_steps(case):
    """spec.topk=2: a batch holding a constrained request takes plain decode steps (a grammar's
    walk over a tree is not built), so the outputs are still the plain constrained ones; the
    unconstrained request alone afterwards is verified through the tree."""
    path, prompts, params, plain = case
    tree = ["spec.algorithm=nextn", "spec.max_batch_size=0", "spec.num_steps=2", "spec.topk=2"]
    with Engine(path, FP32_CPU + tree) as eng:
        outs = eng.generate(input_ids=prompts, sampling_params=params)
        assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in plain]
        assert all(o["meta"].get("spec_verify_steps", 0) == 0 for o in outs[:-1])
        alone = eng.generate(input_ids=prompts[-1:], sampling_params=params[-1:])[0]
        assert alone["output_ids"] == plain[-1]["output_ids"]
        assert alone["meta"]["spec_verify_steps"] >= 1
        assert eng.scheduler.is_memory_clean()
