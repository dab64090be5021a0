"""Every architecture against transformers with the same weights (fp32): Llama, Qwen2, Qwen3,
Qwen3-MoE, Mixtral here for prefill logits; DeepSeek-V2/V3 prefill variants are in test_deepseek.py.
Greedy generation and decode-over-paged-KV run for all seven here."""

from __future__ import annotations

import pytest
import torch
from parity import (FP32_CPU, ID_VOCAB, decode_vs_recompute, extend_batch, hf_greedy, hf_logits,
                    hf_model, make_runner, prefill_logits, prompts_of_lengths, rel_err)

from moeserve import Engine

ARCHS = ["llama", "qwen2", "qwen3", "qwen3_moe", "mixtral"]
ALL_ARCHS = ARCHS + ["deepseek_v2", "deepseek_v3"]


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_logits_match_transformers(tiny_model, arch):
    path = tiny_model(arch, vocab_size=ID_VOCAB)
    runner, ref = make_runner(path), hf_model(path)
    prompts = prompts_of_lengths([5, 17, 9], runner.hf_config.vocab_size)
    for ours, prompt in zip(prefill_logits(runner, prompts), prompts):  # one batch, 3 requests
        assert rel_err(ours, hf_logits(ref, prompt)) < 1e-4


@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_greedy_batch_matches_transformers(tiny_model, arch):
    path = tiny_model(arch, vocab_size=ID_VOCAB)
    ref = hf_model(path)
    prompts = prompts_of_lengths([3, 11, 6, 20], ref.config.vocab_size, seed=1)
    with Engine(path, overrides=FP32_CPU) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params={
            "temperature": 0, "max_new_tokens": 32, "ignore_eos": True})
    for out, prompt in zip(outs, prompts):
        assert out["output_ids"] == hf_greedy(ref, prompt, 32)
        assert out["meta"]["completion_tokens"] == 32
        assert out["meta"]["finish_reason"] == "length"


@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_decode_over_paged_kv_equals_recompute(tiny_model, arch):
    runner = make_runner(tiny_model(arch, vocab_size=ID_VOCAB))
    prompt = prompts_of_lengths([7], runner.hf_config.vocab_size, seed=2)[0]
    decoded, recomputed = decode_vs_recompute(runner, prompt, steps=12)
    assert rel_err(decoded, recomputed) < 1e-4
    assert int(decoded.argmax()) == int(recomputed.argmax())


def test_memory_returns_to_baseline(tiny_model):
    with Engine(tiny_model("qwen3_moe", vocab_size=ID_VOCAB), overrides=FP32_CPU) as engine:
        sched = engine.scheduler
        baseline = sched.cache.available()
        engine.generate(input_ids=[[5, 6, 7], [8, 9]], sampling_params={"max_new_tokens": 5})
        assert sched.is_memory_clean()
        assert sched.cache.available() == baseline  # free + evictable: the prefix cache kept 13
        assert sched.cache.tree.total_size() == 3 + 4 + 2 + 4


def test_bf16_runs_and_agrees_loosely(tiny_model):
    """bf16 on CPU: same argmax as fp32 for most positions (a smoke check, not the GPU parity)."""
    path = tiny_model("llama")
    prompts = prompts_of_lengths([16], 30000, seed=3)
    ref = prefill_logits(make_runner(path), prompts)[0]
    ours = prefill_logits(make_runner(path, ["model.dtype=bfloat16"]), prompts)[0]
    assert rel_err(ours, ref) < 5e-2
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() > 0.8
    assert torch.isfinite(ours).all()


@pytest.mark.usefixtures("fast_paths_unforced")  # a test of the fast path itself
def test_cpu_kernels_run_by_default_and_match_the_torch_ops(tiny_model):
    """A CPU runner uses the C kernels unless told not to (so the parity tests above exercise
    them), and its bf16 decode agrees with the torch-op runner's on the same weights: logits
    close, and the fused greedy head picks a token whose torch logit is the row's max."""
    from moeserve.attention.cpu_backend import CpuAttentionBackend
    from moeserve.layers.norm import RMSNorm

    path = tiny_model("qwen3_moe")
    runner = make_runner(path)
    if runner.cpu_kernels is None:
        pytest.skip("no C compiler: the CPU kernels cannot be built")
    assert isinstance(runner.attn_backend, CpuAttentionBackend)
    assert all(m.cpu_kernels is runner.cpu_kernels for m in runner.model.modules()
               if isinstance(m, RMSNorm))
    torch_ops = make_runner(path, ["model.dtype=bfloat16", "model.cpu_kernels=false"])
    fused = make_runner(path, ["model.dtype=bfloat16"])
    assert type(torch_ops.attn_backend).__name__ == "TorchAttentionBackend"
    prompt = prompts_of_lengths([9], fused.hf_config.vocab_size, seed=4)[0]
    a, full_a = decode_vs_recompute(fused, prompt, steps=6)
    b, _ = decode_vs_recompute(torch_ops, prompt, steps=6)
    assert rel_err(a, b) < 3e-2 and rel_err(a, full_a) < 3e-2
    if fused.greedy_head is None:
        return  # no AVX512-BF16 here: the logits path is the only one
    prompts = prompts_of_lengths([12, 5, 9], fused.hf_config.vocab_size, seed=5)
    with extend_batch(fused, prompts) as fb:
        logits = fused.forward(fb, float_logits=False)  # [3, V] bf16, each prompt's last token
        chosen = fused.forward_greedy(fb)
    assert torch.equal(logits.gather(1, chosen[:, None])[:, 0], logits.max(-1).values)
