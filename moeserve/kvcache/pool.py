"""KV pools: the per-layer tensors that hold keys/values (MHA/GQA) or MLA latents, by slot."""

from __future__ import annotations

import math
import mmap
from abc import ABC, abstractmethod

import torch


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """torch.zeros, except on CPU: there an anonymous memory mapping, which the kernel zeroes page
    by page on first touch, so a pool costs only the pages of slots ever written (torch.zeros
    wrote all of it at start: SmolLM2's 16384-token float32 pool, 0.75 GiB, took 0.6 s of a core)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    if count == 0:
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, count * torch.empty((), dtype=dtype).element_size())
    return torch.frombuffer(buf, dtype=dtype, count=count).view(shape)  # keeps buf alive


class KVPool(ABC):
    """Per-layer KV storage indexed by slot (slot 0 = padding sink).

    `set_kv` writes the new tokens' entries at `loc`; `key_buffer`/`value_buffer` return the whole
    per-layer buffers as [num_slots + 1, kv_heads, dim] views that attention backends gather from.
    """

    size: int
    dtype: torch.dtype

    @abstractmethod
    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None):
        ...

    @abstractmethod
    def key_buffer(self, layer_id: int) -> torch.Tensor:
        ...

    @abstractmethod
    def value_buffer(self, layer_id: int) -> torch.Tensor:
        ...

    @abstractmethod
    def buffers(self) -> list[torch.Tensor]:
        """Every per-layer tensor, [num_slots + 1, ...] each (what a KV transfer registers)."""

    @staticmethod
    def bytes_per_token(num_layers: int, width: int, dtype: torch.dtype) -> int:
        return num_layers * width * torch.empty((), dtype=dtype).element_size()


class MHAKVPool(KVPool):
    """Separate K and V per layer: [size + 1, kv_heads, head_dim] each."""

    def __init__(self, size: int, num_layers: int, kv_heads: int, head_dim: int, v_head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        self.size, self.dtype = size, dtype
        self.k = [zeros((size + 1, kv_heads, head_dim), dtype, device)
                  for _ in range(num_layers)]
        self.v = [zeros((size + 1, kv_heads, v_head_dim), dtype, device)
                  for _ in range(num_layers)]

    def set_kv(self, layer_id, loc, k, v):
        self.k[layer_id][loc] = k.to(self.dtype)
        self.v[layer_id][loc] = v.to(self.dtype)

    def key_buffer(self, layer_id):
        return self.k[layer_id]

    def value_buffer(self, layer_id):
        return self.v[layer_id]

    def buffers(self):
        return self.k + self.v


class MLAKVPool(KVPool):
    """One latent per token per layer: [size + 1, 1, kv_lora_rank + rope_dim].

    The value is the first kv_lora_rank channels of the same buffer (absorbed MLA), so `set_kv`
    ignores v and `value_buffer` is a view.
    """

    def __init__(self, size: int, num_layers: int, kv_lora_rank: int, rope_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        self.size, self.dtype, self.kv_lora_rank = size, dtype, kv_lora_rank
        self.kv = [zeros((size + 1, 1, kv_lora_rank + rope_dim), dtype, device)
                   for _ in range(num_layers)]

    def set_kv(self, layer_id, loc, k, v=None):
        self.kv[layer_id][loc] = k.to(self.dtype)

    def key_buffer(self, layer_id):
        return self.kv[layer_id]

    def value_buffer(self, layer_id):
        return self.kv[layer_id][..., : self.kv_lora_rank]

    def buffers(self):
        return list(self.kv)
