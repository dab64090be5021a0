"""Host-side TMA tensor descriptors (Hopper's bulk copies) for weight tiles, where they apply.

A kernel that reads a weight tile through a descriptor issues one bulk copy per tile instead of
per-thread pointer loads: fewer registers and address computations, and out-of-bounds rows and
columns arrive as zeros. The descriptor is encoded on the host at launch and passed by value, so
it is captured with the launch in a CUDA graph (weights do not move).
"""

from __future__ import annotations

import functools

import torch

from moeserve.env import env

try:  # host-side TMA descriptors (Triton >= 3.4)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: callers fall back to pointer loads
    TensorDescriptor = None


def tma_ok(w: torch.Tensor, interpreted: bool = False) -> bool:
    """w [N, K] can be read through a TMA descriptor: CUDA sm90+ (or, with `interpreted`, a CPU
    tensor under TRITON_INTERPRET=1, for tests), 16-byte aligned base and row stride, unit
    column stride."""
    if TensorDescriptor is None or w.dim() != 2 or w.stride(1) != 1:
        return False
    if w.stride(0) * w.element_size() % 16 or w.data_ptr() % 16:
        return False
    if not w.is_cuda:
        return interpreted and env().triton_interpret
    return _has_tma(w.device.index if w.device.index is not None else torch.cuda.current_device())


@functools.cache
def _has_tma(device_index: int) -> bool:
    """sm90+; asked once per GPU, not on every launch."""
    return torch.cuda.get_device_capability(device_index)[0] >= 9
