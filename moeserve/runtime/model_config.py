"""What the checkpoint and the config decide before a model is built: the device, the dtype
(run-time probes of the CPU's bf16 speed), the checkpoint's HF config and the context length."""

from __future__ import annotations

import os
from typing import Any

import torch

from moeserve.config import MoeserveConfig
from moeserve.config_schema import ConfigError
from moeserve.env import env
from moeserve.kernels.cpu.build import load_cpu_kernels
from moeserve.layers.linear import onednn_bf16_linear_works

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device=cuda but CUDA is not available")
    return torch.device(name)


def cpu_has_native_bf16() -> bool:
    """The CPU multiplies bf16 in hardware (AVX512-BF16 or AMX tiles)."""
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, c, lambda: False)() for c in checks)


def cpu_bf16_is_fast(use_cpu_kernels: bool = True) -> bool:
    """bf16 linears run fast here: oneDNN's prepack on a CPU with native bf16, or, where the
    prepack is off (AVX2-only x86), the C bf16-weight linear built for AVX2 + FMA
    (kernels/cpu/linear.c). Where the prepack works without native bf16 (AVX-512 without BF16)
    it would run the linears, which was not measured: float32 there, as before."""
    if onednn_bf16_linear_works():
        return cpu_has_native_bf16()
    e = env()
    if not use_cpu_kernels or e.disable_cpu_linear:
        return False
    kernels = load_cpu_kernels(e.cache_dir, e.cc)
    return kernels is not None and kernels.fast_linear


def resolve_dtype(name: str, hf_config, device: torch.device,
                  use_cpu_kernels: bool = True) -> torch.dtype:
    """auto: on CPU bfloat16 where bf16 linears are fast (cpu_bf16_is_fast; as vLLM's CPU
    backend: decode there is bound by reading the weights, and bf16 halves them; SmolLM2 batch-16
    decode 126 → 61 ms/step on 2 cores; emulated AVX2 + FMA without native bf16, 1 thread:
    187 → 110, docs/reliability.md), else float32; on GPUs the checkpoint's 16-bit dtype. Parity
    tests pin float32."""
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.bfloat16 if cpu_bf16_is_fast(use_cpu_kernels) else torch.float32
    ckpt = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    ckpt = _DTYPES.get(str(ckpt).replace("torch.", ""), torch.bfloat16)
    return torch.bfloat16 if ckpt == torch.float32 else ckpt


def load_hf_config(path: str):
    from transformers import AutoConfig

    if not os.path.exists(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"model.path={path!r} has no config.json")
    return AutoConfig.from_pretrained(path)


def context_length(cfg: MoeserveConfig, hf_config: Any) -> int:
    """model.context_length, at most the checkpoint's max_position_embeddings: the rotary tables
    (and the positions the model was trained on) end there, as in vLLM and SGLang."""
    limit = hf_config.max_position_embeddings
    if cfg.model.context_length is not None and cfg.model.context_length > limit:
        raise ConfigError("model.context_length", f"{cfg.model.context_length} exceeds the "
                          f"checkpoint's max_position_embeddings ({limit})")
    return cfg.model.context_length or limit
