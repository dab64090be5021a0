"""Whole models through the Triton kernels (attention.backend=triton, moe.backend=triton) in the
interpreter on CPU, float32: logits match transformers' model on the same weights, and decode over
the paged KV equals recomputing the sequence (GQA, Qwen3-MoE, MLA)."""

from __future__ import annotations

import pytest
import torch
from parity import (decode_vs_recompute, hf_logits, hf_model, make_runner, prefill_logits,
                    prompts_of_lengths, rel_err)

from moeserve.layers.moe import MoEExperts

TRITON = ["attention.backend=triton", "moe.backend=triton", "model.cpu_kernels=false"]

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter test; the GPU "
                                "runs the same paths in tests/gpu")


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe", "deepseek_v3"])
def test_triton_paths_match_transformers(tiny_model, arch):
    path = tiny_model(arch)
    runner = make_runner(path, TRITON)
    assert type(runner.attn_backend).__name__ == "TritonAttentionBackend"
    experts = [m for m in runner.model.modules() if isinstance(m, MoEExperts)]
    assert all(m.backend == "triton" for m in experts)
    ref = hf_model(path)
    prompts = prompts_of_lengths([7, 19], runner.hf_config.vocab_size, seed=2)
    for ours, p in zip(prefill_logits(runner, prompts), prompts):
        assert rel_err(ours, hf_logits(ref, p)) < 1e-4
    last, full = decode_vs_recompute(runner, prompts[0], steps=4)
    assert rel_err(last, full) < 1e-4


def test_fresh_prefill_through_sdpa_matches_transformers(tiny_model):
    """attention.sdpa_prefill_min_tokens: a fresh EXTEND step of two prompts attends with torch
    SDPA (GQA as such, one call per request) and still gives transformers' logits; a step
    under the threshold, and decode over the cached prompt, keep the Triton kernels."""
    path = tiny_model("qwen3")  # GQA: 4 query heads over 2 KV heads
    runner = make_runner(path, TRITON + ["attention.sdpa_prefill_min_tokens=20"])
    ref = hf_model(path)
    seen = []
    forward = runner.attn_backend.forward

    def spy(q, k, v, spec, fb, kv_stored=False):
        seen.append(fb.sdpa_prefill)
        return forward(q, k, v, spec, fb, kv_stored)
    runner.attn_backend.forward = spy
    prompts = prompts_of_lengths([7, 19], runner.hf_config.vocab_size, seed=3)
    for ours, p in zip(prefill_logits(runner, prompts), prompts):
        assert rel_err(ours, hf_logits(ref, p)) < 1e-4
    assert seen and set(seen) == {"auto"}  # 26 fresh tokens: every layer through SDPA
    seen.clear()
    last, full = decode_vs_recompute(runner, prompts[1], steps=3)
    assert rel_err(last, full) < 1e-4  # the SDPA prefill stored the KV that decode reads
    assert "" in seen and "auto" in seen  # 19-token prefill and decodes: Triton; recompute: SDPA
