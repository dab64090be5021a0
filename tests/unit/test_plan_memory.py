"""plan_memory counts what the runtime builds: its bf16 parts equal the parameter bytes of a real
(tiny) model by part; FP8 adds one float32 scale per 128x128 block, partial blocks included."""

from __future__ import annotations

import torch

from moeserve.config import compose
from moeserve.layers.moe import MoEExperts
from moeserve.runtime.model_runner import ModelRunner
from moeserve.tools.plan_memory import matrix_bytes, plan_rank


def _bytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def test_bf16_plan_equals_the_built_model(tiny_model):
    path = tiny_model("deepseek_v3")
    cfg = compose(["device=cpu", "model.dtype=bfloat16", "model.cpu_kernels=false"])
    runner = ModelRunner(cfg, path)
    model, c = runner.model, runner.hf_config
    plan = plan_rank(cfg, c, "bf16", 80 << 30)
    attn = _bytes(p for n, p in model.named_parameters()
                  if ".self_attn." in n and "layernorm" not in n)
    experts = _bytes(p for m in model.modules() if isinstance(m, MoEExperts)
                     for p in m.parameters())
    shared = _bytes(p for n, p in model.named_parameters() if ".shared_experts." in n)
    dense = _bytes(p for n, p in model.named_parameters() if ".mlp." in n and "experts" not in n
                   and ".gate." not in n)
    assert plan.attention == attn
    assert plan.experts == experts
    assert plan.shared == shared
    assert plan.dense == dense
    embed = model.model.embed_tokens.weight
    assert plan.embeddings == _bytes([embed]) + (0 if model.lm_head.weight is embed
                                                 else _bytes([model.lm_head.weight]))
    mla = c.kv_lora_rank + c.qk_rope_head_dim
    assert plan.kv_per_token == c.num_hidden_layers * mla * 2
    assert plan.kv_tokens == (plan.budget - plan.weights) // plan.kv_per_token


def test_fp8_plan_equals_the_fp8_resident_model(tiny_model):
    """model.quantization=fp8 builds what the FP8 column counts: e4m3 projections (MLA's kv_b
    too) and experts with their block scales; with model.fp8_lm_head the LM head as well."""
    path = tiny_model("deepseek_v3")
    cfg = compose(["device=cpu", "model.dtype=bfloat16", "model.cpu_kernels=false",
                   "model.quantization=fp8", "model.fp8_lm_head=true"])
    runner = ModelRunner(cfg, path)
    model = runner.model
    plan = plan_rank(cfg, runner.hf_config, "fp8", 80 << 30)
    params = dict(model.named_parameters())
    assert params["model.layers.1.self_attn.q_b_proj.weight"].dtype == torch.float8_e4m3fn
    dense_kv_b = [b for n, b in model.named_buffers() if n.endswith("kv_b_dense")]
    assert len(dense_kv_b) == runner.hf_config.num_hidden_layers  # MLA's bf16 copy of kv_b
    assert plan.attention == _bytes(p for n, p in params.items()
                                    if ".self_attn." in n and "layernorm" not in n) + _bytes(
                                        dense_kv_b)
    assert plan.experts == _bytes(p for m in model.modules() if isinstance(m, MoEExperts)
                                  for p in m.parameters())
    assert plan.shared == _bytes(p for n, p in params.items() if ".shared_experts." in n)
    assert plan.dense == _bytes(p for n, p in params.items() if ".mlp." in n
                                and "experts" not in n and ".gate." not in n)
    assert params["model.layers.1.self_attn.kv_b_proj.weight"].dtype == torch.float8_e4m3fn
    assert params["lm_head.weight"].dtype == torch.float8_e4m3fn
    assert plan.embeddings == _bytes(p for n, p in params.items()
                                     if n.startswith(("lm_head.", "model.embed_tokens.")))


def test_fp8_matrix_bytes_count_partial_blocks():
    assert matrix_bytes(200, 300, "bf16") == 200 * 300 * 2
    assert matrix_bytes(200, 300, "fp8") == 200 * 300 + 2 * 3 * 4  # 2 x 3 blocks of scales
    assert matrix_bytes(256, 128, "fp8") == 256 * 128 + 2 * 1 * 4


def test_presets_fit_only_in_fp8(tmp_path):
    """DeepSeek-V3 on 8 H200 (dp8 x ep8) fits in FP8, not in bf16."""
    from moeserve.tools.make_random import make_random

    path = make_random("deepseek_v3", str(tmp_path / "v3"), config_only=True)
    cfg = compose(["+deploy=deepseek_v3_1x8", f"model.path={path}", "model.load_format=dummy"])
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(path)
    fp8, bf16 = (plan_rank(cfg, c, f, 140 << 30) for f in ("fp8", "bf16"))
    assert fp8.fits and not bf16.fits
    assert fp8.weights < 0.55 * bf16.weights
    assert fp8.kv_tokens > 100_000
