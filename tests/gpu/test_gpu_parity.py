"""bf16 on CUDA against transformers with the same weights (run by scripts/gpu_check.sh).

Tolerance is relative to transformers' own bf16 error: against the fp32 transformers model, our bf16
logits must be about as accurate as transformers' bf16 logits.
"""

from __future__ import annotations

import pytest
import torch
from parity import prefill_logits, prompts_of_lengths, rel_err

from moeserve import Engine
from moeserve.config import compose
from moeserve.core import ForwardMode
from moeserve.runtime.model_runner import ModelRunner

pytestmark = pytest.mark.gpu

ARCHS = ["llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", "deepseek_v2", "deepseek_v3"]
BF16_CUDA = ["device=cuda", "model.dtype=bfloat16"]


def _hf(path: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).cuda().eval()


@torch.no_grad()
def _hf_logits(model, prompt: list[int]) -> torch.Tensor:
    return model(torch.tensor([prompt], device="cuda")).logits[0].float()


PARITY_LENS = [5, 33, 17]  # prompt lengths of the prefill parity tests


def _check_prefill_parity(path: str, runner: ModelRunner, label: str) -> None:
    """Each prompt's prefill logits against transformers' fp32 model, held to transformers'
    own bf16 error."""
    ref32, ref16 = _hf(path, torch.float32), _hf(path, torch.bfloat16)
    prompts = prompts_of_lengths(PARITY_LENS, runner.hf_config.vocab_size)
    for ours, p in zip(prefill_logits(runner, prompts), prompts):
        exact, theirs = _hf_logits(ref32, p), _hf_logits(ref16, p)
        ours_err, hf_err = rel_err(ours, exact), rel_err(theirs, exact)
        print(f"\n[{label}] len {len(p)}: ours vs fp32 {ours_err:.2e}, transformers bf16 vs "
              f"fp32 {hf_err:.2e}, ours vs transformers bf16 {rel_err(ours, theirs):.2e}")
        assert ours_err < 2 * hf_err + 2e-3


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_prefill_logits_as_accurate_as_transformers_bf16(tiny_model, arch):
    path = tiny_model(arch)
    _check_prefill_parity(path, ModelRunner(compose(BF16_CUDA), path), f"bf16 parity {arch}")


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_sdpa_fresh_prefill_as_accurate_as_transformers_bf16(tiny_model, arch):
    """attention.sdpa_prefill_min_tokens=16: the fresh prefill of three prompts attends with
    torch's SDPA (cuDNN where it takes the shape) in an eager step; its logits are held to the
    same bound as the Triton path's."""
    path = tiny_model(arch)
    runner = ModelRunner(compose(BF16_CUDA + ["attention.sdpa_prefill_min_tokens=16"]), path)
    assert runner.sdpa_policy.step(ForwardMode.EXTEND, PARITY_LENS, [0] * len(PARITY_LENS))
    _check_prefill_parity(path, runner, f"sdpa parity {arch}")


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe", "deepseek_v3"])
def test_bf16_greedy_agrees_where_the_choice_is_clear(tiny_model, arch):
    """Random tiny models have near-tied logits; where transformers' fp32 model prefers its top
    token by a clear margin, our bf16 engine must pick it too. Full-length agreement is reported."""
    path = tiny_model(arch)
    ref16, ref32 = _hf(path, torch.bfloat16), _hf(path, torch.float32)
    prompts = prompts_of_lengths([4, 9, 15, 21, 6, 12, 30, 3], 30000, seed=5)
    with Engine(path, overrides=BF16_CUDA) as eng:
        outs = eng.generate(input_ids=prompts, sampling_params={
            "temperature": 0, "max_new_tokens": 32, "ignore_eos": True})
    same_prefix, clear = [], 0
    for out, p in zip(outs, prompts):
        with torch.no_grad():
            theirs = ref16.generate(torch.tensor([p], device="cuda"), max_new_tokens=32,
                                    min_new_tokens=32, do_sample=False, pad_token_id=0)
        theirs = theirs[0, len(p):].tolist()
        same_prefix.append(next((i for i, (a, b) in enumerate(zip(out["output_ids"], theirs))
                                 if a != b), 32))
        top2 = _hf_logits(ref32, p)[-1].topk(2).values
        if float(top2[0] - top2[1]) > 0.05 * float(top2[0].abs()) + 1e-3:
            clear += 1
            assert out["output_ids"][0] == int(_hf_logits(ref32, p)[-1].argmax())
    print(f"\n[bf16 greedy] {arch}: identical-prefix lengths vs transformers bf16 {same_prefix} "
          f"of 32; {clear}/{len(prompts)} prompts with a clear first choice")
