"""DeepSeek-V3 FP8 block-quantized checkpoints (written by make_tiny --fp8, projections not
multiples of 128) load on CPU dequantized exactly: greedy tokens equal transformers' on the
dequantized weights."""

from __future__ import annotations

import json
import os

import torch
from parity import hf_greedy, hf_logits, make_runner, prefill_logits, prompts_of_lengths, rel_err
from safetensors.torch import save_file

from moeserve.tools.make_tiny import make_tiny
from moeserve.tools.tiny_checkpoint import dequantized_checkpoint, read_checkpoint


def _dequantized_copy(fp8_dir: str, out: str) -> str:
    """The same model for transformers: float32 projections, no quantization_config."""
    os.makedirs(out, exist_ok=True)
    save_file(dequantized_checkpoint(read_checkpoint(fp8_dir)),
              os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(fp8_dir, "config.json")) as f:
        cfg = json.load(f)
    cfg.pop("quantization_config")
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f)
    return out


def test_fp8_checkpoint_on_cpu_equals_transformers_on_dequantized_weights(tmp_path):
    from transformers import AutoModelForCausalLM

    fp8 = make_tiny("deepseek_v3", str(tmp_path / "fp8"), seed=3, fp8=True,
                    intermediate_size=200)  # dense MLP rows: one full and one partial block
    tensors = read_checkpoint(fp8)
    assert tensors["model.layers.0.mlp.gate_proj.weight"].dtype == torch.float8_e4m3fn
    assert tensors["model.layers.0.mlp.gate_proj.weight_scale_inv"].shape == (2, 1)
    ref = AutoModelForCausalLM.from_pretrained(_dequantized_copy(fp8, str(tmp_path / "deq")),
                                               dtype=torch.float32).eval()
    runner = make_runner(fp8)
    prompts = prompts_of_lengths([6, 13], runner.hf_config.vocab_size, seed=4)
    for ours, p in zip(prefill_logits(runner, prompts), prompts):
        assert rel_err(ours, hf_logits(ref, p)) < 1e-4
    from moeserve import Engine

    with Engine(fp8, overrides=["device=cpu", "model.dtype=float32"]) as eng:
        outs = eng.generate(input_ids=prompts, sampling_params={
            "temperature": 0, "max_new_tokens": 8, "ignore_eos": True})
    for out, p in zip(outs, prompts):
        assert out["output_ids"] == hf_greedy(ref, p, 8)
