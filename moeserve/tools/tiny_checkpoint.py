"""Reading tiny checkpoints back and converting them: all tensors of a folder, DeepSeek's block
FP8 form of a float checkpoint and the float tensors an FP8 one stands for, and transformers'
MTP model over a checkpoint's MTP layers (the oracles the tests compare against)."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file


def _is_fp8_weight(name: str, t: torch.Tensor) -> bool:
    """DeepSeek-V3 stores its linear projections in FP8 (`*_proj`, `kv_a_proj_with_mqa`);
    embeddings, the LM head, norms, routers and the correction bias stay in higher precision."""
    return t.dim() == 2 and name.endswith(("_proj.weight", "_proj_with_mqa.weight"))


def fp8_checkpoint(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The projections of a checkpoint as e4m3 + `weight_scale_inv` blocks."""
    from moeserve.kernels.fp8_format import quantize_fp8_blocks

    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if _is_fp8_weight(name, t):
            out[name], out[name + "_scale_inv"] = quantize_fp8_blocks(t)
        else:
            out[name] = t
    return out


def dequantized_checkpoint(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors an FP8 checkpoint stands for (float32 projections, no scales): what
    transformers should hold to be compared with a model loaded from the FP8 files."""
    from moeserve.kernels.fp8_format import dequantize_fp8_blocks

    out = {}
    for name, t in tensors.items():
        if name.endswith("_scale_inv"):
            continue
        scale = tensors.get(name + "_scale_inv")
        out[name] = t if scale is None else dequantize_fp8_blocks(t, scale)
    return out


def read_checkpoint(path: str) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory, single-file or sharded."""
    index = os.path.join(path, "model.safetensors.index.json")
    if not os.path.exists(index):
        return load_file(os.path.join(path, "model.safetensors"))
    with open(index) as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
    return {k: v for name in files for k, v in load_file(os.path.join(path, name)).items()}


def hf_mtp_model(main_model, path: str):
    """transformers' generic `MtpModel` with the checkpoint's MTP layers: an MTP drafting oracle.

    NOTE: `MtpModel.from_pretrained` only finds MTP weights at `model.layers.61.*` (DeepSeek-V3's
    layer count); this applies the same renaming for any `num_hidden_layers`.
    """
    from transformers.core_model_loading import convert_and_load_state_dict_in_model
    from transformers.modeling_layers import MtpModel
    from transformers.modeling_utils import LoadStateDictConfig

    config = main_model.config
    if getattr(config, "num_mtp_layers", None) is None:  # DeepseekV2Config has no MTP field
        config.num_mtp_layers = config.num_nextn_predict_layers
    n, k = config.num_hidden_layers, config.num_mtp_layers
    prefixes = tuple(f"model.layers.{i}." for i in range(n, n + k))
    tensors = {key: t for key, t in read_checkpoint(path).items() if key.startswith(prefixes)}
    mtp = MtpModel(main_model, k)
    load_config = LoadStateDictConfig(
        weight_mapping=mtp.get_weight_conversions(main_model), dtype=torch.float32
    )
    info, _ = convert_and_load_state_dict_in_model(mtp, tensors, load_config)
    missing = set(info.missing_keys) - {"embed_tokens.weight", "shared_head.weight"}  # shared
    if missing or info.mismatched_keys:
        raise RuntimeError(f"MTP weights not loaded: {sorted(missing)} {info.mismatched_keys}")
    return mtp.eval()
