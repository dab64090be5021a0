"""Constrained decoding through the Engine (normal and overlap loops) equals transformers' greedy
generation with xgrammar's own logits processor (`xgrammar.contrib.hf`), token for token, on the
embedded SmolLM2 in float32: the masks prefilled on the helper thread, the vectorised mask and
the batched fills change nothing."""

from __future__ import annotations

import json

import pytest
import torch

xgr = pytest.importorskip("xgrammar")

from parity import FP32_CPU  # noqa: E402

from moeserve import Engine  # noqa: E402
from moeserve.models.embedded import embedded_model_path  # noqa: E402

pytestmark = pytest.mark.timeout(600)

ITEM = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                         "qty": {"type": "integer", "minimum": 0, "maximum": 999},
                                         "ok": {"type": "boolean"}},
        "required": ["name", "qty", "ok"]}
GRAMMARS = [("json_schema", json.dumps(ITEM)),
            ("json_schema", json.dumps({"type": "array", "items": ITEM, "minItems": 2})),
            ("regex", "(yes|no), [a-z]{2,8}"), ("ebnf", 'root ::= ("cat" | "dog") " " [0-9]+')]
MAX_NEW = 40


def _hf_constrained(model, c, ids: list[int], spec: tuple[str, str]) -> list[int]:
    from xgrammar.contrib.hf import LogitsProcessor

    kind, source = spec
    compiled = (c.compile_json_schema(source, any_whitespace=False) if kind == "json_schema"
                else c.compile_regex(source) if kind == "regex" else c.compile_grammar(source))
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False,
                             logits_processor=[LogitsProcessor(compiled)])
    return out[0, len(ids):].tolist()


def _prompts(eng) -> list[list[int]]:
    return [eng.apply_chat_template([{"role": "user", "content": f"Describe item {i} as JSON."}])
            for i in range(len(GRAMMARS))]


@pytest.fixture(scope="module")
def reference() -> tuple[list[list[int]], list[list[int]]]:
    """(prompts, transformers' constrained greedy tokens for each)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = embedded_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = [list(tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Describe item {i} as JSON."}], add_generation_prompt=True,
        tokenize=True, return_dict=True)["input_ids"]) for i in range(len(GRAMMARS))]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=model.config.vocab_size)
    compiler = xgr.GrammarCompiler(info)  # one for the four grammars
    return prompts, [_hf_constrained(model, compiler, ids, g) for ids, g in zip(prompts, GRAMMARS)]


@pytest.mark.parametrize("overlap", ["false", "true"])
def test_constrained_greedy_equals_transformers_with_xgrammar(reference, overlap):
    prompts, theirs = reference
    with Engine(overrides=FP32_CPU + [f"scheduler.overlap={overlap}"]) as eng:
        assert _prompts(eng) == prompts
        ours = eng.generate(input_ids=prompts, sampling_params=[
            {"temperature": 0, "max_new_tokens": MAX_NEW, "grammar": g} for g in GRAMMARS])
    for spec, out, ref in zip(GRAMMARS, ours, theirs):
        assert out["output_ids"] == ref, (spec, out["text"])
    assert ours[0]["meta"]["finish_reason"] == "stop"  # the object completed inside MAX_NEW
