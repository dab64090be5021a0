"""Linear layers whose weights are loaded from several checkpoint tensors (declarative packing)."""

from __future__ import annotations

import torch
from torch import nn


class MergedLinear(nn.Linear):
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
