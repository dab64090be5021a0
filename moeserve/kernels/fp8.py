"""Block-scaled FP8 (e4m3) GEMM kernels in the layout of DeepSeek-V3's checkpoints.

Weights: `w` [N, K] float8_e4m3fn with `w_scale` [ceil(N/bn), ceil(K/bk)] float32, so that
w_real[n, k] = w[n, k] * w_scale[n // bn, k // bk] (the checkpoints' `weight_scale_inv`; the block
(bn, bk) is 128 x 128 for DeepSeek). Activations are quantized on the fly per token and group of bk
channels: x_real[t, k] = x_q[t, k] * x_scale[t, k // bk]. The GEMM multiplies FP8 tiles on the
tensor cores (fp32 accumulation) and applies both scales per bk-wide K group, so BLOCK_K = bk.
Dimensions that are not multiples of the block work: the last block is partial and masked.

Small grids (decode: one m-block, few n-blocks) split K over extra programs that write fp32
partial sums, added afterwards: without it a 7168 -> 1536 projection at one token ran on 12 of
the GPU's 132 SMs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moeserve.kernels.fp8_format import FP8, FP8_BLOCK, FP8_MAX, Block, as_block


def quant_fp8_per_token_group(x: torch.Tensor, group: int = FP8_BLOCK
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] (any float dtype) → (x_q [T, K] float8_e4m3fn, scale [T, ceil(K/group)] float32)
    with scale = amax(|group|) / 448 (a tiny floor keeps all-zero groups finite)."""
    t, k = x.shape
    groups = triton.cdiv(k, group)
    x_q = torch.empty((t, k), dtype=FP8, device=x.device)
    scale = torch.empty((t, groups), dtype=torch.float32, device=x.device)
    if t == 0 or k == 0:
        return x_q, scale
    if not x.is_cuda:  # Triton's interpreter rounds float32 -> e4m3 wrongly for some values
        return _quant_torch(x, group, groups)
    x = x if x.stride(-1) == 1 else x.contiguous()
    _quant_group_kernel[(t, groups)](x, x_q, scale, k, x.stride(0), x_q.stride(0),
                                     scale.stride(0), GROUP_SIZE=group, FP8_MAX=FP8_MAX)
    return x_q, scale


def _quant_torch(x: torch.Tensor, group: int, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same quantization in torch ops (the CPU path, and the kernel's reference)."""
    t, k = x.shape
    padded = torch.nn.functional.pad(x.float(), (0, groups * group - k)).view(t, groups, group)
    scale = padded.abs().amax(-1).clamp(min=1e-10) / FP8_MAX  # [T, G]
    q = (padded / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).view(t, groups * group)[:, :k]
    return q.to(FP8).contiguous(), scale


@triton.jit
def _quant_group_kernel(x_ptr, q_ptr, s_ptr, k, stride_x, stride_q, stride_s,
                        GROUP_SIZE: tl.constexpr, FP8_MAX: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    offs = g * GROUP_SIZE + tl.arange(0, GROUP_SIZE)
    mask = offs < k
    x = tl.load(x_ptr + t * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), 0), 1e-10) / FP8_MAX
    q = tl.clamp(x / scale, -FP8_MAX, FP8_MAX)
    tl.store(q_ptr + t * stride_q + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + t * stride_s + g, scale)


@dataclass(frozen=True)
class GemmConfig:
    block_m: int = 16
    block_n: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def gemm_config(t: int, n: int, k: int, block_k: int, device: torch.device) -> GemmConfig:
    """The launch config for [T, K] x [N, K]^T: m-tiles by T; K split when the m x n grid would
    leave most SMs idle (not on CPU: the interpreter runs programs one by one)."""
    if t <= 64:
        block_m = 16 if t <= 16 else 32 if t <= 32 else 64
        cfg = GemmConfig(block_m=block_m)
    else:
        cfg = GemmConfig(block_m=128, num_warps=8)
    if device.type != "cuda":
        return cfg
    programs = triton.cdiv(t, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    groups, sms = triton.cdiv(k, block_k), _num_sms(device.index or 0)
    if programs >= sms or groups < 4:
        return cfg
    split = min(triton.cdiv(2 * sms, programs), groups // 2, 16)
    return GemmConfig(cfg.block_m, cfg.block_n, max(split, 1), cfg.num_warps, cfg.num_stages)


def fp8_block_matmul(x_q: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor,
                     w_scale: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16,
                     block: int | Block = FP8_BLOCK, config: GemmConfig | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """(x_q * x_scale) @ (w * w_scale)^T: x_q [T, K] fp8, x_scale [T, ceil(K/bk)], w [N, K] fp8,
    w_scale [ceil(N/bn), ceil(K/bk)] → [T, N] in out_dtype, fp32 accumulation. `out`: write into
    this [T, N] view (unit column stride) instead of a new tensor."""
    t, k = x_q.shape
    n = w.shape[0]
    bn, bk = as_block(block)
    if out is None:
        out = torch.empty((t, n), dtype=out_dtype, device=x_q.device)
    if t == 0 or n == 0:
        return out
    cfg = config or gemm_config(t, n, k, bk, x_q.device)
    split = min(cfg.split_k, triton.cdiv(k, bk))
    per_split = triton.cdiv(triton.cdiv(k, bk), split)
    split = triton.cdiv(triton.cdiv(k, bk), per_split)  # no empty splits
    dest = out if split == 1 else torch.empty((split, t, n), dtype=torch.float32,
                                              device=x_q.device)
    grid = (triton.cdiv(t, cfg.block_m), triton.cdiv(n, cfg.block_n), split)
    _fp8_block_matmul_kernel[grid](
        x_q, x_scale, w, w_scale, dest, t, n, k, per_split, x_q.stride(0), x_scale.stride(0),
        w.stride(0), w_scale.stride(0), dest.stride(-2), t * n, SCALE_BN=bn,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=bk, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    if split > 1:
        out.copy_(dest.sum(0))
    return out


@triton.jit(do_not_specialize=["m"])
def _fp8_block_matmul_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, m, n, k, groups_per_split,
                             stride_am, stride_asm, stride_bn, stride_bsn, stride_cm,
                             stride_split, SCALE_BN: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (m block, n block, K split): the K loop runs over BLOCK_K-wide groups, each tile
    product scaled by its activation-row scales and its weight block's scale."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = offs_m < m, offs_n < n
    offs_k = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am
    b_rows = b_ptr + offs_n.to(tl.int64)[:, None] * stride_bn
    w_block = offs_n // SCALE_BN  # the weight scale row of each output column
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    g0 = pid_s * groups_per_split
    g1 = tl.minimum(g0 + groups_per_split, tl.cdiv(k, BLOCK_K))
    for g in range(g0, g1):
        kk = g * BLOCK_K + offs_k
        mask_k = kk < k
        a = tl.load(a_rows + kk[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(b_rows + kk[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        a_s = tl.load(as_ptr + offs_m * stride_asm + g, mask=mask_m, other=0.0)  # [BM]
        b_s = tl.load(bs_ptr + w_block * stride_bsn + g, mask=mask_n, other=0.0)  # [BN]
        acc += tl.dot(a, tl.trans(b)) * a_s[:, None] * b_s[None, :]
    c = (c_ptr + pid_s.to(tl.int64) * stride_split + offs_m.to(tl.int64)[:, None] * stride_cm
         + offs_n[None, :])
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def fp8_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
               bias: torch.Tensor | None = None, block: int | Block = FP8_BLOCK) -> torch.Tensor:
    """A linear layer on block-FP8 weights: x [..., K] → [..., N] in x.dtype."""
    x2 = x.reshape(-1, x.shape[-1])
    x_q, x_s = quant_fp8_per_token_group(x2, as_block(block)[1])
    out = fp8_block_matmul(x_q, x_s, w, w_scale, out_dtype=x.dtype, block=block)
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], w.shape[0])
