"""Attention backend names → lazily imported classes."""

from __future__ import annotations

import importlib

from moeserve.attention.base import AttentionBackend

_BACKENDS = {
    "torch": "moeserve.attention.torch_backend:TorchAttentionBackend",
    "cpu": "moeserve.attention.cpu_backend:CpuAttentionBackend",  # takes the CpuKernels
    "triton": "moeserve.attention.triton_backend:TritonAttentionBackend",  # (num_kv_splits=8)
}


def create_attention_backend(name: str, *args, **kwargs) -> AttentionBackend:
    """`args` and `kwargs` go to the backend's constructor (the cpu backend takes the compiled
    kernels, the triton one `pdl`)."""
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from {sorted(_BACKENDS)}")
    module, cls = _BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)(*args, **kwargs)
