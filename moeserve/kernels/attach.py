"""Handing kernel objects to the modules that declare a slot for them."""

from __future__ import annotations

from typing import Any

from torch import nn


def attach_ops(model: nn.Module, attr: str, ops: Any) -> int:
    """Set `attr` to `ops` on every module of `model` declaring that attribute (as a class
    attribute: `cpu_kernels`, `gpu_ops`); returns how many. Modules use the ops only where their
    own conditions (device, dtype, layout) hold, else their torch ops."""
    modules = [m for m in model.modules() if hasattr(m, attr)]
    for m in modules:
        setattr(m, attr, ops)
    return len(modules)
