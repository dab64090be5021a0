"""DeepSeek MLA in both forms (absorbed, MHA with chunked decompression: docs/mla.md) against
transformers, float32 on CPU: the torch reference path and the Triton kernel (interpreted)."""

from __future__ import annotations

import pytest
from parity import FP32_CPU, hf_greedy, hf_logits, hf_model, make_runner, prefill_logits, \
    prompts_of_lengths, rel_err

from moeserve import Engine
from moeserve.attention.base import AttentionBackend

FORMS = {  # name: overrides
    "mha_torch": ["attention.mla_form=mha", "attention.backend=torch"],
    "mha_torch_pieces": ["attention.mla_form=mha", "attention.backend=torch",
                         "attention.mla_mha_chunk_tokens=16"],
    "mha_triton_pieces": ["attention.mla_form=mha", "attention.backend=triton",
                          "attention.mla_mha_chunk_tokens=24"],
}


@pytest.fixture
def mha_pieces(monkeypatch):
    """Counts the pieces any backend attends in the MHA form (so a test sees the form ran)."""
    seen = []
    for cls in {AttentionBackend, *_subclasses(AttentionBackend)}:
        if "attend_mla_piece" in vars(cls):
            orig = vars(cls)["attend_mla_piece"]

            def spy(self, *args, _orig=orig):
                seen.append(args[3].n)
                return _orig(self, *args)

            monkeypatch.setattr(cls, "attend_mla_piece", spy)
    return seen


def _subclasses(cls):
    import moeserve.attention.torch_backend  # noqa: F401 (registers the subclasses)
    import moeserve.attention.triton_backend  # noqa: F401

    out = set()
    for sub in cls.__subclasses__():
        out |= {sub, *_subclasses(sub)}
    return out


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_mha_form_prefill_logits_match_transformers(tiny_model, arch, form, mha_pieces):
    path = tiny_model(arch)
    runner, ref = make_runner(path, FORMS[form]), hf_model(path)
    prompts = prompts_of_lengths([5, 17, 40], runner.hf_config.vocab_size)
    for ours, prompt in zip(prefill_logits(runner, prompts), prompts):
        assert rel_err(ours, hf_logits(ref, prompt)) < 1e-5
    chunk = 16 if "torch_pieces" in form else 24 if "pieces" in form else None
    assert mha_pieces, "the MHA form did not run"
    if chunk:  # 62 positions in several pieces: the log-sum-exp merge ran
        assert len(mha_pieces) > len(runner.model.model.layers) and max(mha_pieces) <= chunk


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_mha_form_greedy_is_token_identical_to_transformers(tiny_model, backend, mha_pieces):
    """Prefill chunked by the scheduler (extends over a cached prefix), every extend step in the
    MHA form over pieces of 8 positions, decode absorbed: transformers' greedy tokens."""
    path = tiny_model("deepseek_v3")
    ref = hf_model(path)
    prompts = prompts_of_lengths([3, 21, 12, 30], ref.config.vocab_size, seed=1)
    over = FP32_CPU + ["attention.mla_form=mha", f"attention.backend={backend}",
                       "attention.mla_mha_chunk_tokens=8", "scheduler.chunked_prefill_size=16"]
    if backend == "triton":
        over.append("moe.backend=torch")
    with Engine(path, overrides=over) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params={
            "temperature": 0, "max_new_tokens": 12, "ignore_eos": True})
    for out, prompt in zip(outs, prompts):
        assert out["output_ids"] == hf_greedy(ref, prompt, 12)
    assert mha_pieces and max(mha_pieces) <= 8, "the MHA form did not run"
