"""Structured outputs on one GPU: the CUDA mask equals xgrammar's CPU kernel; constrained decoding
in the overlap loop (deferred tokens, matchers advanced on the helper thread) equals the normal
loop token for token, and every token is one xgrammar's own matcher accepts; a completing grammar
ends its requests with text that matches it."""

from __future__ import annotations

import json
import re

import pytest
import torch
from parity import prompts_of_lengths

from moeserve import Engine

xgr = pytest.importorskip("xgrammar")
pytestmark = pytest.mark.gpu

BF16_CUDA = ["device=cuda", "model.dtype=bfloat16"]
ITEM = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                         "n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["name", "n"]}
# neither completes within 24 tokens: every request runs the same length in both loops
OPEN = [("json_schema", json.dumps({"type": "array", "items": ITEM, "minItems": 64})),
        ("regex", "[a-z ,.]{1000}")]


def test_cuda_mask_equals_xgrammar_cpu_kernel():
    from moeserve.runtime.grammar import apply_token_mask

    g = torch.Generator().manual_seed(0)
    vocab, rows = 129280, [0, 2, 3]
    bits = torch.randint(-2**31, 2**31 - 1, (5, (vocab + 31) // 32), dtype=torch.int32,
                         generator=g)
    logits = torch.randn(5, vocab, generator=g).bfloat16()
    ref = logits.clone()
    xgr.apply_token_bitmask_inplace(ref, bits, vocab_size=vocab, indices=rows)
    got = apply_token_mask(logits.cuda(), bits[rows].cuda(), rows, vocab, copy=True)
    assert torch.equal(got.cpu(), ref)


def _accepted_by_xgrammar(path: str, spec: tuple[str, str], ids: list[int]) -> bool:
    from transformers import AutoTokenizer

    from moeserve.runtime.grammar import GrammarCompiler

    tok = AutoTokenizer.from_pretrained(path)
    matcher = xgr.GrammarMatcher(GrammarCompiler(tok, 129280).compile(spec))
    return all(matcher.accept_token(t) for t in ids)


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_overlap_loop_grammar_equals_normal_loop(tiny_model, arch):
    path = tiny_model(arch)
    prompts = prompts_of_lengths([5, 17, 9, 30, 3, 12], 30000, seed=11)
    params = [{"temperature": 0.8 if i % 3 == 2 else 0, "seed": i, "max_new_tokens": 24,
               "ignore_eos": True, "grammar": OPEN[i % 2]} for i in range(len(prompts))]

    def run(overlap: bool) -> list[list[int]]:
        with Engine(path, overrides=BF16_CUDA + [f"scheduler.overlap={overlap}"]) as eng:
            return [o["output_ids"] for o in eng.generate(input_ids=prompts,
                                                          sampling_params=params)]

    normal, overlap = run(False), run(True)
    assert all(len(o) == 24 for o in normal)
    assert overlap == normal
    for ids, p in zip(normal, params):
        assert _accepted_by_xgrammar(path, p["grammar"], ids)


def test_completing_grammar_stops_with_matching_text(tiny_model):
    pattern = "(yes|no), [a-z]{2,8}"
    with Engine(tiny_model("qwen3_moe"), overrides=BF16_CUDA) as eng:
        outs = eng.generate(input_ids=prompts_of_lengths([7, 11, 4], 30000, seed=2),
                            sampling_params={"temperature": 0, "max_new_tokens": 40,
                                             "grammar": ("regex", pattern)})
    for o in outs:
        assert o["meta"]["finish_reason"] == "stop"
        assert re.fullmatch(pattern, o["text"]), o["text"]
