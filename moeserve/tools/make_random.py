"""Random-weight checkpoints with real model shapes, for benchmarks (no hub access needed).

    python -m moeserve.tools.make_random --shape qwen3_30b_a3b --layers 4 --out DIR [--device cuda]
    python -m moeserve.tools.make_random --shape qwen3_30b_a3b --config-only --out DIR

`--config-only` writes config.json + tokenizer for `model.load_format=dummy` (full-size models whose
weights would not fit on disk). All shapes use the DeepSeek tokenizer's vocabulary (129280 ids) so
that any tokenizer id is a valid embedding row.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch

from moeserve.tools.make_tiny import CHAT_TEMPLATE, VOCAB_SIZE, load_tokenizer

SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3_30b_a3b": ("Qwen3MoeConfig", dict(
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=40960,
        rope_theta=1e6, rms_norm_eps=1e-6)),
    "llama3_8b": ("LlamaConfig", dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0,
        rms_norm_eps=1e-5)),
    "deepseek_v2_lite": ("DeepseekV2Config", dict(
        hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
        num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512,
        q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2, first_k_dense_replace=1,
        routed_scaling_factor=1.0, topk_method="greedy", n_group=1, topk_group=1,
        max_position_embeddings=163840, rms_norm_eps=1e-6)),
    # DeepSeek-V3 / R1 (671B); its checkpoint is FP8 in 128x128 blocks (quantization_config)
    "deepseek_v3": ("DeepseekV3Config", dict(
        hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        n_routed_experts=256, num_experts_per_tok=8, n_shared_experts=1, first_k_dense_replace=3,
        routed_scaling_factor=2.5, n_group=8, topk_group=4, norm_topk_prob=True,
        num_nextn_predict_layers=1, max_position_embeddings=163840, rms_norm_eps=1e-6,
        quantization_config={"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                             "weight_block_size": [128, 128]})),
}


def shape_config(shape: str, num_layers: int | None = None):
    import transformers

    cls_name, kwargs = SHAPES[shape]
    kwargs = {**kwargs, "vocab_size": VOCAB_SIZE, "bos_token_id": 0, "eos_token_id": 1,
              "tie_word_embeddings": False}
    if num_layers is not None:
        kwargs["num_hidden_layers"] = num_layers
    cfg = getattr(transformers, cls_name)(**kwargs)
    cfg.architectures = [cls_name.replace("Config", "ForCausalLM")]
    return cfg


def make_random(shape: str, out: str, num_layers: int | None = None, config_only: bool = False,
                device: str = "cpu", seed: int = 0) -> str:
    from transformers import AutoModelForCausalLM

    os.makedirs(out, exist_ok=True)
    cfg = shape_config(shape, num_layers)
    tok = load_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(out)
    if config_only:
        cfg.save_pretrained(out)
        return out
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--config-only", action="store_true")
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    print(make_random(args.shape, args.out, args.layers, args.config_only, args.device))


if __name__ == "__main__":
    main()
