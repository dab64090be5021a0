"""Linear layers whose weights stay in DeepSeek's block FP8 (e4m3 + a float32 scale per block).

`weight` [N, K] float8_e4m3fn and `weight_scale_inv` [ceil(N/bn), ceil(K/bk)] float32 are named
as in the checkpoints, so FP8 tensors load by name; a float tensor loaded into them is quantized
into the same blocks (kernels/fp8_format.py, `model.quantization=fp8`). Two forward paths:
- "triton": activations quantized per token and group of bk channels, then the block-scaled FP8
  GEMM with fp32 accumulation (kernels/fp8.py), as on CUDA;
- "torch": the reference, dequantize the weight and matmul in the activation dtype (no activation
  quantization); CPU runs it, and it is selectable anywhere by setting `backend`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moeserve.kernels.fp8_format import (FP8, FP8_BLOCK, Block, check_block, dequantize_fp8_blocks,
                                         scale_shape)

FP8_BACKENDS = ("triton", "torch")


def fp8_parameter(*shape: int, device=None) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=FP8, device=device), requires_grad=False)


def scale_parameter(*shape: int, device=None) -> nn.Parameter:
    return nn.Parameter(torch.ones(shape, dtype=torch.float32, device=device), requires_grad=False)


class Fp8Linear(nn.Module):
    """y = x @ dequant(weight)^T (+ bias): x [..., K] → [..., N] in x's dtype."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 block: int | Block = FP8_BLOCK, backend: str = "triton",
                 bias_dtype: torch.dtype | None = None, device=None):
        super().__init__()
        if backend not in FP8_BACKENDS:
            raise ValueError(f"FP8 linear backend {backend!r} is not one of {FP8_BACKENDS}")
        self.in_features, self.out_features = in_features, out_features
        self.block = check_block(block)
        self.backend = backend
        self.weight = fp8_parameter(out_features, in_features, device=device)
        self.weight_scale_inv = scale_parameter(*scale_shape(out_features, in_features,
                                                             self.block), device=device)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=bias_dtype, device=device),
                                 requires_grad=False) if bias else None
        for p in (self.weight, self.weight_scale_inv):
            p.fp8_block = self.block  # the loader quantizes float tensors into these blocks

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"block={list(self.block)}, backend={self.backend}")

    def dequantized(self) -> torch.Tensor:
        """The weight it stands for, float32 [N, K]."""
        return dequantize_fp8_blocks(self.weight, self.weight_scale_inv, self.block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.backend == "torch":
            return F.linear(x, self.dequantized().to(x.dtype), self.bias)
        from moeserve.kernels.fp8 import fp8_linear

        return fp8_linear(x, self.weight, self.weight_scale_inv, self.bias, self.block)


class Fp8MergedLinear(Fp8Linear):
    """One FP8 linear over concatenated output shards (e.g. gate_up_proj = [gate | up]), each shard
    quantized in blocks of its own, as the checkpoint stores them: the scale rows are each
    shard's ceil(size / bn) rows, in output order. Where every shard starts on a block row the
    layout is that of one matrix and one GEMM runs; otherwise one GEMM per shard, into its columns.
    """

    def __init__(self, in_features: int, output_sizes: list[int], shard_names: list[str],
                 bias: bool = False, block: int | Block = FP8_BLOCK, backend: str = "triton",
                 bias_dtype: torch.dtype | None = None, device=None):
        super().__init__(in_features, sum(output_sizes), bias, block, backend, bias_dtype, device)
        bn, bk = self.block
        kb = scale_shape(1, in_features, self.block)[1]
        self.weight_scale_inv = scale_parameter(sum(-(-s // bn) for s in output_sizes), kb,
                                                device=device)
        self.weight_scale_inv.fp8_block = self.block
        # shard → (first row, rows, first scale row, scale rows)
        self.shards: dict[str, tuple[int, int, int, int]] = {}
        row = srow = 0
        for name, size in zip(shard_names, output_sizes):
            self.shards[name] = (row, size, srow, -(-size // bn))
            row, srow = row + size, srow + -(-size // bn)
        self.aligned = all(start % bn == 0 for start, *_ in self.shards.values())
        for p in (self.weight, self.weight_scale_inv, self.bias):
            if p is not None:
                p.weight_loader = self.weight_loader
                p.expected_shards = set(shard_names)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        """One shard's weight (fp8 rows), scale (its block rows) or bias."""
        start, size, sstart, ssize = self.shards[shard_id]
        if param is self.weight_scale_inv:
            start, size = sstart, ssize
        if loaded.shape[0] != size or loaded.shape[1:] != param.shape[1:]:
            raise ValueError(f"shard {shard_id!r}: expected {(size, *param.shape[1:])}, "
                             f"got {tuple(loaded.shape)}")
        param.data[start : start + size].copy_(loaded)

    def dequantized(self) -> torch.Tensor:
        return torch.cat([dequantize_fp8_blocks(w, s, self.block) for w, s in self._shard_views()])

    def _shard_views(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(self.weight[r : r + n], self.weight_scale_inv[sr : sr + sn])
                for r, n, sr, sn in self.shards.values()]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.backend == "torch" or self.aligned:
            return super().forward(x)
        from moeserve.kernels.fp8 import fp8_block_matmul, quant_fp8_per_token_group

        x2 = x.reshape(-1, x.shape[-1])  # [T, K]
        x_q, x_s = quant_fp8_per_token_group(x2, self.block[1])
        out = torch.empty((x2.shape[0], self.out_features), dtype=x.dtype, device=x.device)
        for (start, size, _, _), (w, s) in zip(self.shards.values(), self._shard_views()):
            fp8_block_matmul(x_q, x_s, w, s, block=self.block, out=out[:, start : start + size])
        if self.bias is not None:
            out += self.bias
        return out.view(*x.shape[:-1], self.out_features)
