"""DeepSeek's block-FP8 weight format in torch ops: e4m3 values, one float32 scale per 128 x 128
block (`weight_scale_inv`: real = stored * scale). Used at load time (dequantize on CPU, quantize
bf16 checkpoints for `model.quantization=fp8`) and to write test checkpoints; no Triton needed."""

from __future__ import annotations

import math

import torch

FP8_BLOCK = 128
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value


def dequantize_fp8_blocks(weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """weight: [N, K] fp8, scale_inv: [ceil(N/128), ceil(K/128)] → float32 [N, K]."""
    n, k = weight.shape
    scale = scale_inv.float().repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)
    return weight.float() * scale[:n, :k]


def quantize_fp8_blocks(w: torch.Tensor, block: int = FP8_BLOCK
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float → (w_q float8_e4m3fn [N, K], scale [ceil(N/block), ceil(K/block)] float32),
    scale = the block's amax / 448; partial edge blocks are padded with zeros for their amax."""
    n, k = w.shape
    nb, kb = math.ceil(n / block), math.ceil(k / block)
    padded = torch.zeros((nb * block, kb * block), dtype=torch.float32, device=w.device)
    padded[:n, :k] = w.float()
    tiles = padded.view(nb, block, kb, block)
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-10) / FP8_MAX  # [nb, kb]
    q = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view(nb * block, kb * block)
    return q[:n, :k].to(FP8).contiguous(), scale
