"""DeepSeek's block-FP8 weight format in torch ops: e4m3 values, one float32 scale per 128 x 128
block (`weight_scale_inv`: real = stored * scale). Used at load time (dequantize on CPU, quantize
bf16 checkpoints for `model.quantization=fp8`) and to write test checkpoints; no Triton needed.

Blocks are (rows, cols) = `quantization_config.weight_block_size`; 128 x 128 everywhere DeepSeek
ships FP8, other sizes are accepted where both are powers of two of at least 16 (the Triton
kernels tile K by the column block).
"""

from __future__ import annotations

import math

import torch

FP8_BLOCK = 128
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
Block = tuple[int, int]


def as_block(block: int | Block) -> Block:
    return (block, block) if isinstance(block, int) else (int(block[0]), int(block[1]))


def check_block(block: int | Block) -> Block:
    """`block` as (rows, cols), refused (ValueError) unless both are powers of two >= 16."""
    bn, bk = as_block(block)
    for b in (bn, bk):
        if b < 16 or b & (b - 1):
            raise ValueError(f"FP8 weight block {[bn, bk]}: sizes must be powers of two >= 16")
    return bn, bk


def scale_shape(rows: int, cols: int, block: int | Block = FP8_BLOCK) -> tuple[int, int]:
    bn, bk = as_block(block)
    return math.ceil(rows / bn), math.ceil(cols / bk)


def dequantize_fp8_blocks(weight: torch.Tensor, scale_inv: torch.Tensor,
                          block: int | Block = FP8_BLOCK) -> torch.Tensor:
    """weight: [N, K] fp8, scale_inv: [ceil(N/bn), ceil(K/bk)] → float32 [N, K]."""
    n, k = weight.shape
    bn, bk = as_block(block)
    scale = scale_inv.float().repeat_interleave(bn, 0).repeat_interleave(bk, 1)
    return weight.float() * scale[:n, :k]


def quantize_fp8_blocks(w: torch.Tensor, block: int | Block = FP8_BLOCK
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float → (w_q float8_e4m3fn [N, K], scale [ceil(N/bn), ceil(K/bk)] float32),
    scale = the block's amax / 448; partial edge blocks are padded with zeros for their amax."""
    n, k = w.shape
    bn, bk = as_block(block)
    nb, kb = scale_shape(n, k, (bn, bk))
    padded = torch.zeros((nb * bn, kb * bk), dtype=torch.float32, device=w.device)
    padded[:n, :k] = w.float()
    tiles = padded.view(nb, bn, kb, bk)
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-10) / FP8_MAX  # [nb, kb]
    q = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view(nb * bn, kb * bk)
    return q[:n, :k].to(FP8).contiguous(), scale
