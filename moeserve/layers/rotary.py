"""Rotary position embeddings (default, linear, llama3, YaRN, ... via transformers' rope init)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def rope_parameters(hf_config: Any) -> dict:
    """The rope dict of an HF config, whether it uses transformers-5 `rope_parameters` or the older
    `rope_theta` + `rope_scaling` pair."""
    params = getattr(hf_config, "rope_parameters", None)
    if params:
        if "rope_theta" in params or "rope_type" in params:
            return dict(params)
        # per-layer-type dicts (e.g. {"full_attention": {...}}): take the first
        return dict(next(iter(params.values())))
    out = dict(getattr(hf_config, "rope_scaling", None) or {})
    out.setdefault("rope_type", out.pop("type", "default"))
    out["rope_theta"] = getattr(hf_config, "rope_theta", 10000.0)
    return out


def rope_inv_freq(hf_config: Any, rotary_dim: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [rotary_dim / 2], attention_factor) for the config's rope type."""
    params = rope_parameters(hf_config)
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        theta = params["rope_theta"]
        exponent = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float() / rotary_dim
        return 1.0 / (theta**exponent), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, factor = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    return inv_freq.float(), float(factor)


class RotaryEmbedding(nn.Module):
    """Applies rope to the first `rotary_dim` channels of q and k.

    neox style rotates halves (x[:d/2], x[d/2:]); interleaved (GPT-J / DeepSeek) rotates pairs
    (x[0::2], x[1::2]). cos/sin carry the type's attention factor (YaRN mscale).
    """

    def __init__(self, inv_freq: torch.Tensor, attention_factor: float, max_position: int,
                 is_neox_style: bool = True):
        super().__init__()
        self.rotary_dim = inv_freq.numel() * 2
        self.is_neox_style = is_neox_style
        # computed on the CPU in float32 (exact, device-independent), then moved to the default
        # device, which a `with torch.device(...)` block around model construction sets
        inv_freq = inv_freq.detach().to("cpu", torch.float32)
        t = torch.arange(max_position, dtype=torch.float32, device="cpu")
        freqs = torch.outer(t, inv_freq)  # [P, d/2]
        cos, sin = freqs.cos() * attention_factor, freqs.sin() * attention_factor
        # neox: [cos | cos | -sin | sin], so that rope(x) = x * cos2 + swap_halves(x) * sin2;
        # interleaved: [cos | sin]
        parts = [cos, cos, -sin, sin] if is_neox_style else [cos, sin]
        cache = torch.cat(parts, dim=-1).to(torch.get_default_device())
        self.register_buffer("cos_sin_cache", cache, persistent=False)  # [P, 2d] or [P, d]

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, H, D], k: [T, Hkv, D]; positions: [T]."""
        if q.shape[-1] != k.shape[-1]:
            return self.rotate(positions, q), self.rotate(positions, k)
        # one pass over q and k together: half the (small, per-op-bound) elementwise ops
        qk = self.rotate(positions, torch.cat([q, k], dim=1))  # [T, H + Hkv, D]
        return qk[:, : q.shape[1]], qk[:, q.shape[1] :]

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x: [T, N, D] (any number of heads) → rope on each head's first rotary_dim channels."""
        d = self.rotary_dim
        table = self.cos_sin_cache[positions][:, None, :]  # [T, 1, 2d] or [T, 1, d]
        rot, rest = x[..., :d], x[..., d:]
        rot_f = rot.float()
        if self.is_neox_style:
            # x1 * cos - x2 * sin | x2 * cos + x1 * sin, as x * [cos|cos] + [x2|x1] * [-sin|sin]
            # (the same two products and one sum per element: bit-identical)
            out = rot_f * table[..., :d] + rot_f.roll(d // 2, dims=-1) * table[..., d:]
        else:
            cos, sin = table.chunk(2, dim=-1)
            x1, x2 = rot_f[..., 0::2], rot_f[..., 1::2]
            out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
        out = out.to(x.dtype)
        return out if rest.shape[-1] == 0 else torch.cat([out, rest], dim=-1)


def get_rope(hf_config: Any, rotary_dim: int, max_position: int,
             is_neox_style: bool = True) -> RotaryEmbedding:
    inv_freq, factor = rope_inv_freq(hf_config, rotary_dim)
    return RotaryEmbedding(inv_freq, factor, max_position, is_neox_style)
