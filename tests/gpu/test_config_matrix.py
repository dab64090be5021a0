"""Every dtype x attention backend x MoE backend x CUDA graphs combination the schema accepts runs
on CUDA (issue 44), on tiny MoE models: Qwen3-MoE and a DeepSeek-V3 with DeepSeek's real MLA head
dims (kv_lora_rank 512, qk nope/rope 128/64, v 128: the tiles that overflowed shared memory in
float32). Each combination serves greedy requests through the Engine; where transformers' float32
model prefers its first token by a clear margin, ours must pick it; the identical-prefix lengths
against transformers are printed. MLA runs its MHA form for the prefill (mla_form=mha). The torch
attention backend cannot be captured (it reads lengths on the host): with cuda_graph.enabled=true
it is refused when the config is composed."""

from __future__ import annotations

import itertools

import pytest
import torch
from parity import prompts_of_lengths

from moeserve import Engine
from moeserve.config import ConfigError, compose

pytestmark = pytest.mark.gpu

MLA_REAL_DIMS = dict(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                     v_head_dim=128, num_attention_heads=4)
MODELS = {"qwen3_moe": ("qwen3_moe", {}), "deepseek_v3_mla": ("deepseek_v3", MLA_REAL_DIMS)}
DTYPES = ["float32", "bfloat16", "float16"]
COMBOS = list(itertools.product(MODELS, DTYPES, ["torch", "triton"], ["torch", "triton"],
                                [False, True]))
PROMPTS = prompts_of_lengths([5, 40, 17, 90], 30000, seed=7)
NEW = 8


@pytest.fixture(scope="module")
def reference(tiny_model):
    """Per model: (path, transformers float32 greedy tokens, clear-first-choice flags)."""
    from transformers import AutoModelForCausalLM

    out = {}
    for name, (arch, over) in MODELS.items():
        path = tiny_model(arch, **over)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
        toks, clear = [], []
        with torch.no_grad():
            for p in PROMPTS:
                ids = torch.tensor([p], device="cuda")
                g = hf.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                                pad_token_id=0)
                toks.append(g[0, len(p):].tolist())
                top2 = hf(ids).logits[0, -1].float().topk(2).values
                clear.append(float(top2[0] - top2[1]) > 0.02 * float(top2[0].abs()) + 1e-3)
        out[name] = (path, toks, clear)
        del hf
    torch.cuda.empty_cache()
    return out


@pytest.mark.parametrize("model,dtype,attn,moe,graphs", COMBOS,
                         ids=["-".join(map(str, c)) for c in COMBOS])
def test_every_accepted_combination_runs(reference, model, dtype, attn, moe, graphs):
    path, ref, clear = reference[model]
    over = ["device=cuda", f"model.dtype={dtype}", f"attention.backend={attn}",
            f"moe.backend={moe}", f"cuda_graph.enabled={str(graphs).lower()}",
            "cuda_graph.max_bs=8", "cuda_graph.max_extend_tokens=64",
            "cache.max_total_tokens=4096", "attention.mla_form=mha"]
    if graphs and attn == "torch":  # refused when composed, naming the key
        with pytest.raises(ConfigError, match="cuda_graph.enabled"):
            compose(over)
        return
    with Engine(path, overrides=over) as eng:
        outs = eng.generate(input_ids=PROMPTS, sampling_params={
            "temperature": 0, "max_new_tokens": NEW, "ignore_eos": True})
    same = [next((i for i, (a, b) in enumerate(zip(o["output_ids"], r)) if a != b), NEW)
            for o, r in zip(outs, ref)]
    print(f"\n[matrix] {model} {dtype} attention={attn} moe={moe} graphs={graphs}: "
          f"identical-prefix lengths vs transformers fp32 {same} of {NEW}")
    for o, r, c in zip(outs, ref, clear):
        assert len(o["output_ids"]) == NEW
        if c:
            assert o["output_ids"][0] == r[0]


def test_cache_that_cannot_fit_fails_at_start_with_the_numbers(tiny_model):
    from moeserve.runtime.model_runner import ModelRunner

    path = tiny_model(*MODELS["deepseek_v3_mla"][:1], **MODELS["deepseek_v3_mla"][1])
    free = torch.cuda.mem_get_info()[0]
    with pytest.raises(ConfigError, match="cache.max_total_tokens") as e:
        ModelRunner(compose(["device=cuda", "model.dtype=bfloat16",
                             f"cache.max_total_tokens={free // 1000}"]), path)
    print(f"\n[matrix] oversized cache refused: {e.value}")
    assert "GiB free after the weights" in str(e.value)
