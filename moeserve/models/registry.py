"""Architecture name (HF `architectures[0]`) → model class, imported lazily."""

from __future__ import annotations

import importlib

_MODELS = {
    "LlamaForCausalLM": "moeserve.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "moeserve.models.llama:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "moeserve.models.llama:Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM": "moeserve.models.qwen3_moe:Qwen3MoeForCausalLM",
    "MixtralForCausalLM": "moeserve.models.qwen3_moe:MixtralForCausalLM",
    "DeepseekV2ForCausalLM": "moeserve.models.deepseek:DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM": "moeserve.models.deepseek:DeepseekV3ForCausalLM",
}


class UnknownArchitectureError(ValueError):
    pass


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def model_class(architecture: str) -> type:
    if architecture not in _MODELS:
        raise UnknownArchitectureError(
            f"unknown architecture {architecture!r} in config.json; supported: "
            f"{', '.join(supported_architectures())}")
    module, name = _MODELS[architecture].split(":")
    return getattr(importlib.import_module(module), name)
