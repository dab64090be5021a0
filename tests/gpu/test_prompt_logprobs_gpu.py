"""Prompt logprobs on CUDA (run by scripts/gpu_check.sh): with the GPU's defaults (extend-step and
decode CUDA graphs, Triton attention, the overlap loop) the prompt tokens' logprobs of a float32
model equal transformers' log_softmax on the same weights, chunked and beside decoding requests,
and scoring-only requests (max_new_tokens 0) generate nothing."""

from __future__ import annotations

import random

import pytest
import torch

from moeserve import Engine

pytestmark = pytest.mark.gpu

FP32_CUDA = ["device=cuda", "model.dtype=float32"]


@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])
def test_prompt_logprobs_match_transformers_on_cuda(tiny_model, arch):
    from transformers import AutoModelForCausalLM

    path = tiny_model(arch)
    rng = random.Random(0)
    shared = [rng.randrange(100, 5000) for _ in range(40)]
    prompts = [shared + [rng.randrange(100, 5000) for _ in range(n)] for n in (60, 5, 0)]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    with Engine(path, FP32_CUDA + ["scheduler.chunked_prefill_size=32"]) as eng:
        eng.generate(input_ids=[shared + [7]], sampling_params={"max_new_tokens": 1})
        outs = eng.generate(input_ids=prompts + prompts[:1],
                            sampling_params=[{"max_new_tokens": 0}] * 3 + [
                                {"max_new_tokens": 16, "temperature": 0}],
                            logprob_start_len=0, top_logprobs_num=2)
        for prompt, out in zip(prompts, outs):
            with torch.no_grad():
                logp = torch.log_softmax(hf(torch.tensor([prompt]).cuda()).logits[0].float(), -1)
            want = [logp[i - 1, prompt[i]].item() for i in range(1, len(prompt))]
            got = out["meta"]["input_logprobs"]
            assert got[0] is None and len(got) == len(prompt) and out["output_ids"] == []
            diff = max(abs(a - b) for a, b in zip(got[1:], want))
            print(f"\n[prompt logprobs cuda] {arch} len {len(prompt)}: max |d| {diff:.2e}")
            assert diff < 1e-3
        assert len(outs[3]["output_ids"]) == 16
        assert eng.scheduler.is_memory_clean()
