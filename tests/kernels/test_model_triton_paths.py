"""Whole models through the Triton kernels (attention.backend=triton, moe.backend=triton) in the
interpreter on CPU, float32: logits match transformers' model on the same weights, and decode over
the paged KV equals recomputing the sequence (GQA, Qwen3-MoE, MLA)."""

from __future__ import annotations

import pytest
import torch
from parity import (decode_vs_recompute, hf_logits, hf_model, make_runner, prefill_logits,
                    prompts_of_lengths, rel_err)

from moeserve.core import ForwardMode
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
        seen.append(fb.sdpa_prefill is not None)
        return forward(q, k, v, spec, fb, kv_stored)
    runner.attn_backend.forward = spy
    prompts = prompts_of_lengths([7, 19], runner.hf_config.vocab_size, seed=3)
    for ours, p in zip(prefill_logits(runner, prompts), prompts):
        assert rel_err(ours, hf_logits(ref, p)) < 1e-4
    assert seen and all(seen)  # 26 fresh tokens: every layer through SDPA
    seen.clear()
    last, full = decode_vs_recompute(runner, prompts[1], steps=3)
    assert rel_err(last, full) < 1e-4  # the SDPA prefill stored the KV that decode reads
    assert False in seen and True in seen  # 19-token prefill, decodes: Triton; recompute: SDPA


def _causal_attention_f64(q, k, v, scale):
    """Float64 causal attention of one request, K/V heads repeated for GQA."""
    group = q.shape[1] // k.shape[1]
    q, k, v = (x.double().transpose(0, 1) for x in (q, k.repeat_interleave(group, 1),
                                                    v.repeat_interleave(group, 1)))
    s = q @ k.transpose(1, 2) * scale
    s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
    return (s.softmax(-1) @ v).transpose(0, 1)


def test_sdpa_prefill_returns_the_kernels_output_for_a_whole_step_request():
    """One request owning every row: SDPA's own token-major output comes back (no copy into
    out); several requests: each is written into out. Both equal float64 attention."""
    from moeserve.attention.sdpa_prefill import sdpa_prefill

    torch.manual_seed(0)
    q, k, v = torch.randn(13, 4, 16), torch.randn(13, 2, 16), torch.randn(13, 2, 16)
    out = torch.zeros(13, 4, 16)
    got = sdpa_prefill(q, k, v, [13], 0.25, out)
    assert got is not out and not out.any()
    assert rel_err(got, _causal_attention_f64(q, k, v, 0.25)) < 1e-5
    got = sdpa_prefill(q, k, v, [5, 8], 0.25, out)
    assert got is out
    for rows in (slice(0, 5), slice(5, 13)):
        ref = _causal_attention_f64(q[rows], k[rows], v[rows], 0.25)
        assert rel_err(out[rows], ref) < 1e-5


def test_mixed_step_sends_only_fresh_prompts_through_sdpa(tiny_model):
    """A MIXED step of a decode rider, a prefix hit and a fresh 21-token prompt: only the fresh
    one attends with SDPA (the others keep the Triton kernel over the pool), and every row's
    logits are transformers' on the whole sequence, as with SDPA off."""
    path = tiny_model("qwen3")
    runner = make_runner(path, TRITON + ["attention.sdpa_prefill_min_tokens=20"])
    ref, mem = hf_model(path), runner.memory
    a, b, c = prompts_of_lengths([9, 14, 21], runner.hf_config.vocab_size, seed=6)
    rows = mem.req_to_token.alloc(3)
    slots = [mem.allocator.alloc(len(p)) for p in (a, b, c)]
    for row, s in zip(rows, slots):
        mem.req_to_token.write(row, 0, s)
    fb = runner.make_batch(ForwardMode.EXTEND, a[:8] + b[:6], [*range(8), *range(6)],
                           torch.cat([slots[0][:8], slots[1][:6]]), rows[:2], [0, 0], [8, 6])
    runner.forward(fb)  # 14 fresh tokens, under the threshold: Triton
    assert fb.sdpa_prefill is None

    def mixed():
        return runner.make_batch(ForwardMode.MIXED, a[8:] + b[6:] + c,
                                 [8, *range(6, 14), *range(21)],
                                 torch.cat([slots[0][8:], slots[1][6:], slots[2]]), rows,
                                 [8, 6, 0], [1, 8, 21], return_all_logits=True)
    fb = mixed()
    on = runner.forward(fb)
    assert fb.sdpa_prefill.backend == "auto" and fb.sdpa_prefill.requests == [False, False, True]
    runner.sdpa_policy = None
    fb = mixed()
    off = runner.forward(fb)
    assert fb.sdpa_prefill is None and rel_err(on, off) < 1e-5
    got_a, got_b, got_c = on.split([1, 8, 21])
    assert rel_err(got_a, hf_logits(ref, a)[8:]) < 1e-4
    assert rel_err(got_b, hf_logits(ref, b)[6:]) < 1e-4
    assert rel_err(got_c, hf_logits(ref, c)) < 1e-4
