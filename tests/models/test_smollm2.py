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


def test_default_dtype_says_paris_and_is_as_accurate_as_transformers():
    """model.dtype=auto on this CPU (bf16 where it is native, else float32): the chat answer still
    says Paris, and the prefill logits are about as close to fp32 transformers as transformers'
    own logits in the same dtype."""
    from transformers import AutoModelForCausalLM

    from moeserve.config import compose
    from moeserve.runtime.model_config import resolve_dtype
    from moeserve.runtime.model_runner import ModelRunner

    path = embedded_model_path()
    with Engine(overrides=["device=cpu"]) as eng:
        ids = eng.apply_chat_template(QUESTION)
        out = eng.generate(input_ids=[ids], sampling_params={"temperature": 0,
                                                             "max_new_tokens": 32})[0]
    assert "Paris" in out["text"]
    runner = ModelRunner(compose(["device=cpu"]), path)
    dtype = resolve_dtype("auto", runner.hf_config, torch.device("cpu"))
    assert runner.dtype == dtype
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    theirs = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    prompt = list(range(1000, 1040))
    exact = hf_logits(ref, prompt)
    ours_err = rel_err(prefill_logits(runner, [prompt])[0], exact)
    theirs_err = rel_err(hf_logits(theirs, prompt).float(), exact)
    assert ours_err <= 1.5 * theirs_err + 1e-4, (ours_err, theirs_err)
