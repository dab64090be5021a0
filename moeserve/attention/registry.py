"""Attention backend names → lazily imported classes."""

from __future__ import annotations

import importlib

from moeserve.attention.base import AttentionBackend

_BACKENDS = {
    "torch": "moeserve.attention.torch_backend:TorchAttentionBackend",
}


def create_attention_backend(name: str) -> AttentionBackend:
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from {sorted(_BACKENDS)}")
    module, cls = _BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)()
