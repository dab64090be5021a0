"""Linear layers: a CPU-prepacked variant and one whose weights are loaded from several checkpoint
tensors (declarative packing)."""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING

import torch
from torch import nn

from moeserve.env import env, log_forced_off

if TYPE_CHECKING:  # importing it imports Triton
    from moeserve.kernels.cpu.ops import CpuKernels
    from moeserve.kernels.triton.ops import TritonOps

logger = logging.getLogger(__name__)


class Linear(nn.Linear):
    """nn.Linear that can run from a oneDNN-prepacked copy of its weight on CPU (`pack`), and on
    CUDA through the Triton GEMV at decode batch 1 (`gpu_ops.linear`: at most LINEAR_MAX_M rows,
    kernels/triton/gemv.py, where it beat cuBLAS' M=1 GEMMs: 1.04-2.6x on Qwen3-30B-A3B's linears).

    Why the prepack: for bf16 on CPU, F.linear re-lays out the weight on every call; a prepacked
    weight gives bit-identical outputs 1.3-2x faster at decode batch sizes (lm_head 129280x64 at
    16 tokens: 1.9 -> 1.0 ms; SmolLM2's MLP 3072x576: 0.21 -> 0.15 ms). The packed copy is taken
    once, after the weights are loaded; the parameter stays the source of truth for loading and
    state_dict.
    """

    packed: torch.Tensor | None = None
    gpu_ops: TritonOps | None = None  # set on CUDA models (kernels.triton.ops)
    cpu_kernels: CpuKernels | None = None  # set on CPU models (kernels/cpu/ops.py)
    w16: torch.Tensor | None = None  # the weight packed for cpu_kernels.linear (bf16, no oneDNN)

    def pack(self) -> bool:
        """Prepack for CPU bf16 (the only dtype where oneDNN matches F.linear bit for bit);
        returns whether it did."""
        w = self.weight
        if w.device.type != "cpu" or w.dtype != torch.bfloat16 or not onednn_bf16_linear_works():
            return False
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), 16)
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gpu_ops is not None and self.gpu_ops.usable(x):
            out = self.gpu_ops.linear(x, self.weight, self.bias)
            if out is not None:
                return out
        if self.w16 is not None and x.dtype == torch.bfloat16:
            return self.cpu_kernels.linear(x, self.w16, self.out_features, self.bias)
        if self.packed is None or x.dtype != torch.bfloat16:
            return super().forward(x)
        x2 = x.reshape(-1, x.shape[-1])  # [T, in]
        out = torch.ops.mkldnn._linear_pointwise(x2, self.packed, self.bias, "none", [None], "")
        return out.view(*x.shape[:-1], out.shape[-1])


_HAS_ONEDNN_LINEAR = (torch.backends.mkldnn.is_available()
                      and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def onednn_bf16_linear_works() -> bool:
    """Run-time probe: oneDNN's bf16 prepack needs AVX512-BW/VL/DQ or AVX-NE-CONVERT, which the
    flags alone do not tell (it raises on AVX2-only CPUs); without it F.linear runs.
    MOESERVE_DISABLE_ONEDNN_BF16=1 forces it off (tests of the fallback)."""
    if env().disable_onednn_bf16:
        log_forced_off("MOESERVE_DISABLE_ONEDNN_BF16", "oneDNN bf16 linear prepack")
        return False
    return _onednn_bf16_probe()


@functools.cache
def _onednn_bf16_probe() -> bool:
    if not _HAS_ONEDNN_LINEAR:
        return False
    try:
        w = torch.zeros(16, 16, dtype=torch.bfloat16)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 16)
        torch.ops.mkldnn._linear_pointwise(w, packed, None, "none", [None], "")
        return True
    except RuntimeError as e:
        logger.info("oneDNN bf16 linear prepack unavailable on this CPU (%s): F.linear instead",
                    str(e).splitlines()[0])
        return False


def pack_linears(model: nn.Module) -> int:
    """Prepack every `Linear` of a loaded CPU model (see Linear.pack); returns how many."""
    return sum(m.pack() for m in model.modules() if isinstance(m, Linear))


class MergedLinear(Linear):
    """One matmul over concatenated output shards, e.g. qkv_proj = [q | k | v].

    Checkpoint tensors load through `weight_loader(param, tensor, shard_id)`; shard ids are the names
    given in `shard_names`, in output order.
    """

    def __init__(self, in_features: int, output_sizes: list[int], shard_names: list[str],
                 bias: bool = False):
        super().__init__(in_features, sum(output_sizes), bias=bias)
        offsets = [0]
        for size in output_sizes:
            offsets.append(offsets[-1] + size)
        self.shards = {name: (offsets[i], output_sizes[i]) for i, name in enumerate(shard_names)}
        for param in (self.weight, self.bias) if bias else (self.weight,):
            param.weight_loader = self.weight_loader
            param.expected_shards = set(shard_names)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        start, size = self.shards[shard_id]
        if loaded.shape[0] != size or loaded.shape[1:] != param.shape[1:]:
            raise ValueError(
                f"shard {shard_id!r}: expected {(size, *param.shape[1:])}, got {tuple(loaded.shape)}"
            )
        param.data[start : start + size].copy_(loaded)


def pack_bf16_linears(model: torch.nn.Module, kernels: CpuKernels) -> int:
    """bf16 weights, float32 arithmetic: each bf16 `Linear` that oneDNN did not prepack (CPUs
    without AVX512-BW/BF16, e.g. AVX2-only x86, or MOESERVE_DISABLE_ONEDNN_BF16) runs
    `CpuKernels.linear` instead of torch's bf16 matmul (emulated AVX2, one thread: SmolLM2's MLP
    3072 x 576 at 16 tokens, 4.9 ms torch bf16 / 1.6 ms torch float32 / 0.83 ms this kernel).
    Off with MOESERVE_DISABLE_CPU_LINEAR; returns how many were packed."""
    if env().disable_cpu_linear:
        log_forced_off("MOESERVE_DISABLE_CPU_LINEAR", "the bf16-weight linear kernel")
        return 0
    if not kernels.fast_linear:
        return 0
    linears = [m for m in model.modules() if isinstance(m, Linear) and m.packed is None
               and m.weight.dtype == torch.bfloat16 and m.weight.device.type == "cpu"]
    for m in linears:
        m.w16 = kernels.pack_linear(m.weight.detach())
    if linears:
        logger.info("%d bf16 linear layers run the bf16-weight kernel (float32 arithmetic)",
                    len(linears))
    return len(linears)
