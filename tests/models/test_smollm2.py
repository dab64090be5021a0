"""The embedded default model through our Engine: token-identical to transformers, answers Paris."""

from __future__ import annotations

import torch
from parity import FP32_CPU, hf_logits, make_runner, prefill_logits, rel_err

from moeserve import Engine
from moeserve.models.embedded import embedded_model_path

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_greedy_chat_matches_transformers_and_says_paris():
    from transformers import AutoModelForCausalLM

    path = embedded_model_path()
    with Engine(overrides=FP32_CPU) as eng:  # model_path=None: the embedded default
        ids = eng.apply_chat_template(QUESTION)
        out = eng.generate(input_ids=[ids], sampling_params={"temperature": 0,
                                                             "max_new_tokens": 32})[0]
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = ref.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)
    theirs = theirs[0, len(ids):].tolist()
    assert out["output_ids"] == theirs[: len(out["output_ids"])]
    assert len(out["output_ids"]) == len(theirs)  # both stop at the same EOS (or at 32)
    assert "Paris" in out["text"]


def test_prefill_logits_match_transformers():
    from transformers import AutoModelForCausalLM

    path = embedded_model_path()
    runner = make_runner(path)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = list(range(1000, 1040))
    assert rel_err(prefill_logits(runner, [prompt])[0], hf_logits(ref, prompt)) < 1e-4
