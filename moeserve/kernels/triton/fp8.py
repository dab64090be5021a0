"""Block-scaled FP8 (e4m3) GEMM kernels in the layout of DeepSeek-V3's checkpoints.

Weights: `w` [N, K] float8_e4m3fn with `w_scale` [ceil(N/bn), ceil(K/bk)] float32, so that
w_real[n, k] = w[n, k] * w_scale[n // bn, k // bk] (the checkpoints' `weight_scale_inv`; the block
(bn, bk) is 128 x 128 for DeepSeek). Activations are quantized per token and group of bk
channels: x_real[t, k] = x_q[t, k] * x_scale[t, k // bk]. The GEMM multiplies FP8 tiles on the
tensor cores (fp32 accumulation) and applies both scales per bk-wide K group, so BLOCK_K = bk.
Dimensions that are not multiples of the block work: the last block is partial and masked.

The GEMM kernel either reads pre-quantized activations (x_q, x_scale) or quantizes float ones
itself (`QUANT_A`: each program quantizes the K groups of its rows as it reads them, with the
quantization kernel's own code, so the values are bit-identical to quantize-then-GEMM); decode
(M <= 16) runs the latter, one launch per linear. Small grids split K over extra programs (without
it a 7168 -> 576 projection at one token ran on 5 of the GPU's 132 SMs): each writes fp32
partials and the last split of a tile to finish adds them in split order, in the same launch.
Which kernel a linear runs at which M (and torch._scaled_mm) is layers/fp8_linear.py's choice.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moeserve.kernels.fp8_format import FP8, FP8_BLOCK, FP8_MAX, Block, as_block
from moeserve.kernels.triton.pdl import launch_kwargs, pdl_wait
from moeserve.kernels.triton.tma import TensorDescriptor, tma_ok

# Hopper's FP8 wgmma accumulates a tl.dot's K products at reduced precision (Triton's sm90
# default); these kernels promote to float32 once per 128-wide K group, as DeepSeek's recipe does.
# EXACT_DOT (read at each launch): widen the e4m3 tiles to bf16 first (exact) for float32
# accumulation: the FP8 accuracy tests' way to tell a kernel bug from the accumulator; ~3x slower
# at M = 4096 on an H100 (docs/fp8.md).
EXACT_DOT = False
SPLIT_TILES = 1024  # split-K tiles one launch may count on (per-device int32 counters)


def quant_fp8_per_token_group(x: torch.Tensor, group: int = FP8_BLOCK, col_major: bool = False,
                              rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] (any float dtype) → (x_q [R, K] float8_e4m3fn, scale [R, ceil(K/group)] float32)
    with scale = amax(|group|) / 448 (a tiny floor keeps all-zero groups finite). R = rows (>= T;
    rows past T are zeros, padding for torch._scaled_mm) or T. `col_major`: the kernel writes the
    scales column-major (strides (1, R)), the layout torch._scaled_mm reads, so no copy."""
    t, k = x.shape
    rows = t if rows is None else rows
    groups = triton.cdiv(k, group)
    x_q = torch.empty((rows, k), dtype=FP8, device=x.device)
    scale = (torch.empty((groups, rows), dtype=torch.float32, device=x.device).t() if col_major
             else torch.empty((rows, groups), dtype=torch.float32, device=x.device))
    if rows == 0 or k == 0:
        return x_q, scale
    if not x.is_cuda:  # Triton's interpreter rounds float32 -> e4m3 wrongly for some values
        q, s = _quant_torch(torch.nn.functional.pad(x, (0, 0, 0, rows - t)), group, groups)
        return x_q.copy_(q), scale.copy_(s)
    _launch_quant(x, x_q, scale, group)
    return x_q, scale


def _launch_quant(x: torch.Tensor, x_q: torch.Tensor, scale: torch.Tensor, group: int) -> None:
    """The Triton quantization of x [T, K] into x_q [R, K] and scale [R, G] (any strides)."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    _quant_group_kernel[(x_q.shape[0], scale.shape[1])](
        x, x_q, scale, x.shape[0], x.shape[1], x.stride(0), x_q.stride(0), scale.stride(0),
        scale.stride(1), GROUP_SIZE=group, FP8_MAX=FP8_MAX, EXACT_E4M3=not x.is_cuda)


def _quant_torch(x: torch.Tensor, group: int, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same quantization in torch ops (the CPU path, and the kernel's reference)."""
    t, k = x.shape
    padded = torch.nn.functional.pad(x.float(), (0, groups * group - k)).view(t, groups, group)
    scale = padded.abs().amax(-1).clamp(min=1e-10) / FP8_MAX  # [T, G]
    q = (padded / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).view(t, groups * group)[:, :k]
    return q.to(FP8).contiguous(), scale


@triton.jit
def _e4m3_rtne(v):
    """float32 v (|v| <= 448) rounded to the nearest e4m3 value, ties to even, with float32 adds
    (v + c - c, c = 1.5 * 2^23 ulp): the hardware cast's result, which the interpreter's cast
    gets wrong where rounding carries into the next binade or ties. Interpreter only."""
    exp = ((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    ulp_exp = tl.maximum(exp, -6) - 3  # e4m3: 3 mantissa bits, subnormals below 2^-6
    c = (((ulp_exp + 150) << 23) | 0x400000).to(tl.float32, bitcast=True)
    return (v + c) - c


@triton.jit
def _quant_group(x, FP8_MAX: tl.constexpr, EXACT_E4M3: tl.constexpr):
    """x [R, G] float32 → (q [R, G] float32 on e4m3 values, scale [R]): one 128-group per row.
    Shared by the quantization kernel and the GEMM's QUANT_A path (bit-identical values)."""
    scale = tl.maximum(tl.max(tl.abs(x), 1), 1e-10) / FP8_MAX
    q = tl.clamp(x / scale[:, None], -FP8_MAX, FP8_MAX)
    if EXACT_E4M3:
        q = _e4m3_rtne(q)
    return q, scale


@triton.jit
def _quant_group_kernel(x_ptr, q_ptr, s_ptr, t, k, stride_x, stride_q, stride_st, stride_sg,
                        GROUP_SIZE: tl.constexpr, FP8_MAX: tl.constexpr,
                        EXACT_E4M3: tl.constexpr):
    """Program (row, group); rows >= t (padding) are zeros."""
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    offs = g * GROUP_SIZE + tl.arange(0, GROUP_SIZE)
    mask = offs < k
    k_row = tl.where(row < t, k, 0)  # rows past t: zeros
    x = tl.load(x_ptr + row * stride_x + offs[None, :], mask=offs[None, :] < k_row,
                other=0.0).to(tl.float32)  # [1, GROUP]
    q, scale = _quant_group(x, FP8_MAX, EXACT_E4M3)
    tl.store(q_ptr + row * stride_q + offs[None, :], q.to(q_ptr.dtype.element_ty),
             mask=mask[None, :])
    tl.store(s_ptr + row * stride_st + g * stride_sg + tl.arange(0, 1), scale)


@dataclass(frozen=True)
class GemmConfig:
    block_m: int = 16
    block_n: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    swap_ab: bool = False  # the weight tile as tl.dot's A operand (module docstring)
    # weight tiles through a TMA tensor descriptor (Hopper's bulk copies) instead of per-thread
    # pointer loads; fused (QUANT_A) launches on CUDA only, where `tma_ok` holds
    tma: bool = False


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def _split_counters(device: torch.device) -> torch.Tensor:
    """Arrival counters of split-K tiles, zero between launches (each tile's last split resets
    its own). NOTE: launches on one device run in stream order, as moeserve's forward does."""
    return torch.zeros(SPLIT_TILES, dtype=torch.int32, device=device)


def gemm_config(t: int, n: int, k: int, block_k: int, device: torch.device) -> GemmConfig:
    """The launch config for pre-quantized [T, K] x [N, K]^T: m-tiles by T; K split when the
    m x n grid would leave most SMs idle (not on CPU: the interpreter runs programs one by one)."""
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


def fused_config(n: int, k: int, block_k: int, device: torch.device,
                 rows: int = 16) -> GemmConfig:
    """Decode (M <= 16, QUANT_A): a weight-read-bound GEMV, which needs every SM streaming.
    - One row (`rows` 1; Fp8Linear's large weights at batch 1): the weight tile is tl.dot's A
      operand (SWAP_AB: 128 weight rows fill Hopper's 64-row wgmma tiles, one activation row
      would waste them), read through TMA (`tma`), 128-row tiles and K split until ~2 programs
      per SM (each split >= 2 K groups), 4 stages; at >= 2 tiles per SM no split and 3 stages,
      4 from 4 tiles per SM (the LM head). From the H200 sweeps (`bench.fp8_gemm --gemv-sweep`,
      graphs, cold weights, µs): 7168 -> 36864 70.5 at 128 / split 1 / 3 stages / TMA (72.1
      with pointer loads at 64 columns, the previous default; 94.9 with 4 stages); 7168 ->
      129280 218.7 at 128 / 1 / 4 / TMA (4.24 TB/s; 234.3 before, 225.4 with 3 stages);
      16384 -> 7168 34.8 and 18432 -> 7168 39.0 at 128 / split 4 / 4 / TMA (35.8 and 40.2
      with pointer loads; 38.0 and 42.9 with 3 stages).
    - More rows: 64-column tiles and K split until about 3 programs per SM, 4 stages."""
    if device.type != "cuda":
        return GemmConfig(block_m=16, block_n=128, swap_ab=rows == 1)
    groups, sms = triton.cdiv(k, block_k), _num_sms(device.index or 0)
    if rows == 1:
        n_tiles = triton.cdiv(n, 128)
        if n_tiles >= 2 * sms:
            return GemmConfig(block_m=16, block_n=128, num_warps=4,
                              num_stages=4 if n_tiles >= 4 * sms else 3, swap_ab=True, tma=True)
        split = max(1, min(2 * sms // n_tiles, groups // 2))
        return GemmConfig(block_m=16, block_n=128, split_k=split, num_warps=4, num_stages=4,
                          swap_ab=True, tma=True)
    n_tiles = triton.cdiv(n, 64)
    split = 1 if n_tiles >= 2 * sms else min(triton.cdiv(3 * sms, n_tiles), max(groups // 2, 1))
    return GemmConfig(block_m=16, block_n=64, split_k=split, num_warps=4, num_stages=4)


def fp8_block_matmul(x_q: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor,
                     w_scale: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16,
                     block: int | Block = FP8_BLOCK, config: GemmConfig | None = None,
                     out: torch.Tensor | None = None,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """(x_q * x_scale) @ (w * w_scale)^T (+ bias [N]): x_q [T, K] fp8, x_scale [T, ceil(K/bk)]
    (any strides), w [N, K] fp8, w_scale [ceil(N/bn), ceil(K/bk)] → [T, N] in out_dtype, fp32
    accumulation. `out`: write into this [T, N] view (unit column stride), not a new tensor."""
    t, k = x_q.shape
    if out is None:
        out = torch.empty((t, w.shape[0]), dtype=out_dtype, device=x_q.device)
    cfg = config or gemm_config(t, w.shape[0], k, as_block(block)[1], x_q.device)
    return _launch_gemm(x_q, x_scale, w, w_scale, out, as_block(block), cfg, bias)


def fp8_quant_matmul(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                     block: int | Block = FP8_BLOCK, config: GemmConfig | None = None,
                     out: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                     pdl: bool = False) -> torch.Tensor:
    """quant(x) @ (w * w_scale)^T (+ bias) in one launch: x [T, K] float, quantized per token and
    group inside the GEMM exactly as quant_fp8_per_token_group does → [T, N] in x.dtype (or
    `out`). `pdl`: a programmatic dependent launch (w must be a parameter nothing writes
    during the forward)."""
    bn, bk = as_block(block)
    if out is None:
        out = torch.empty((x.shape[0], w.shape[0]), dtype=x.dtype, device=x.device)
    x = x if x.stride(-1) == 1 else x.contiguous()
    cfg = config or fused_config(w.shape[0], x.shape[1], bk, x.device, x.shape[0])
    return _launch_gemm(x, None, w, w_scale, out, (bn, bk), cfg, bias, pdl)


def _launch_gemm(a: torch.Tensor, a_scale: torch.Tensor | None, w: torch.Tensor,
                 w_scale: torch.Tensor, out: torch.Tensor, block: Block, cfg: GemmConfig,
                 bias: torch.Tensor | None, pdl: bool = False) -> torch.Tensor:
    """a_scale None: `a` is float and quantized in the kernel (QUANT_A). `pdl`: a programmatic
    dependent launch (pdl.py) that loads its first weight tile before the wait."""
    (t, k), n = a.shape, w.shape[0]
    if t == 0 or n == 0:
        return out
    bn, bk = block
    groups = triton.cdiv(k, bk)
    grid_mn = triton.cdiv(t, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    split = min(cfg.split_k, groups) if grid_mn <= SPLIT_TILES else 1
    per_split = triton.cdiv(groups, split)
    split = triton.cdiv(groups, per_split)  # no empty splits
    counters = _split_counters(a.device) if split > 1 else out
    partials = torch.empty((split, t, n), dtype=torch.float32, device=a.device) if split > 1 \
        else out
    a_s, s_strides = (a, (0, 0)) if a_scale is None else (a_scale, a_scale.stride())
    grid = (triton.cdiv(t, cfg.block_m), triton.cdiv(n, cfg.block_n), split)
    if cfg.tma and a_scale is None and tma_ok(w):
        _fp8_tma_matmul_kernel[grid](
            a, TensorDescriptor.from_tensor(w, [cfg.block_n, bk]), w_scale, out,
            out if bias is None else bias, partials, counters, t, n, k, per_split, a.stride(0),
            w_scale.stride(0), out.stride(0), t * n, SCALE_BN=bn, BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n, BLOCK_K=bk, SPLIT_K=split, HAS_BIAS=bias is not None,
            FP8_MAX=FP8_MAX, SWAP_AB=cfg.swap_ab, EXACT_DOT=EXACT_DOT, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages, **launch_kwargs(pdl))
        return out
    _fp8_block_matmul_kernel[grid](
        a, a_s, w, w_scale, out, out if bias is None else bias, partials, counters, t, n, k,
        per_split, a.stride(0),
        *s_strides, w.stride(0), w_scale.stride(0), out.stride(0), t * n, SCALE_BN=bn,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=bk, SPLIT_K=split,
        QUANT_A=a_scale is None, HAS_BIAS=bias is not None, FP8_MAX=FP8_MAX,
        EXACT_E4M3=not a.is_cuda, SWAP_AB=cfg.swap_ab, EXACT_DOT=EXACT_DOT,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_kwargs(pdl))
    return out


@triton.jit(do_not_specialize=["m"])
def _fp8_block_matmul_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, bias_ptr, part_ptr, count_ptr,
                             m, n, k, groups_per_split, stride_am, stride_asm, stride_asg,
                             stride_bn, stride_bsn, stride_cm, stride_part,
                             SCALE_BN: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                             QUANT_A: tl.constexpr, HAS_BIAS: tl.constexpr,
                             FP8_MAX: tl.constexpr, EXACT_E4M3: tl.constexpr,
                             SWAP_AB: tl.constexpr, EXACT_DOT: tl.constexpr,
                             USE_PDL: tl.constexpr):
    """Program (m block, n block, K split): the K loop runs over BLOCK_K-wide groups, each tile
    product scaled by its activation-row scales and its weight block's scale. SWAP_AB: the
    product is formed as w_tile @ a_tile^T ([BLOCK_N, BLOCK_M]) and transposed once at the end.
    The first group's weight tile loads before the PDL wait (weights only)."""
    offs_m, offs_n, mask_m, mask_n, offs_k, a_rows, w_block, g0, g1 = _program_tile(
        a_ptr, m, n, k, groups_per_split, stride_am, SCALE_BN, BLOCK_M, BLOCK_N, BLOCK_K)
    b_rows = b_ptr + offs_n.to(tl.int64)[:, None] * stride_bn
    b_first = tl.load(b_rows + (g0 * BLOCK_K + offs_k)[None, :],
                      mask=mask_n[:, None] & (g0 * BLOCK_K + offs_k < k)[None, :], other=0.0)
    pdl_wait(USE_PDL)
    acc = _fp8_group(a_rows, as_ptr, bs_ptr, b_first, g0, offs_m, offs_k, w_block, mask_m, mask_n,
                     k, stride_asm, stride_asg, stride_bsn, BLOCK_M, BLOCK_N, BLOCK_K, QUANT_A,
                     FP8_MAX, EXACT_E4M3, SWAP_AB, EXACT_DOT)
    for g in range(g0 + 1, g1):
        kk = g * BLOCK_K + offs_k
        b = tl.load(b_rows + kk[None, :], mask=mask_n[:, None] & (kk < k)[None, :], other=0.0)
        acc += _fp8_group(a_rows, as_ptr, bs_ptr, b, g, offs_m, offs_k, w_block, mask_m, mask_n,
                          k, stride_asm, stride_asg, stride_bsn, BLOCK_M, BLOCK_N, BLOCK_K,
                          QUANT_A, FP8_MAX, EXACT_E4M3, SWAP_AB, EXACT_DOT)
    if SWAP_AB:
        acc = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
    _write_tile(acc, c_ptr, bias_ptr, part_ptr, count_ptr, offs_m, offs_n, mask_m, mask_n, n,
                stride_cm, stride_part, BLOCK_M, BLOCK_N, SPLIT_K, HAS_BIAS)


@triton.jit(do_not_specialize=["m"])
def _fp8_tma_matmul_kernel(a_ptr, w_desc, bs_ptr, c_ptr, bias_ptr, part_ptr, count_ptr, m, n, k,
                           groups_per_split, stride_am, stride_bsn, stride_cm, stride_part,
                           SCALE_BN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                           FP8_MAX: tl.constexpr, SWAP_AB: tl.constexpr,
                           EXACT_DOT: tl.constexpr, USE_PDL: tl.constexpr):
    """`_fp8_block_matmul_kernel` with QUANT_A, its weight tiles [BLOCK_N, BLOCK_K] read through
    the tensor descriptor `w_desc` (TMA; out-of-bounds rows and columns arrive as zeros)."""
    offs_m, offs_n, mask_m, mask_n, offs_k, a_rows, w_block, g0, g1 = _program_tile(
        a_ptr, m, n, k, groups_per_split, stride_am, SCALE_BN, BLOCK_M, BLOCK_N, BLOCK_K)
    n0 = tl.program_id(1) * BLOCK_N
    b_first = w_desc.load([n0, g0 * BLOCK_K])
    pdl_wait(USE_PDL)
    acc = _fp8_group(a_rows, a_ptr, bs_ptr, b_first, g0, offs_m, offs_k, w_block, mask_m, mask_n,
                     k, 0, 0, stride_bsn, BLOCK_M, BLOCK_N, BLOCK_K, True, FP8_MAX, False, SWAP_AB,
                     EXACT_DOT)
    for g in range(g0 + 1, g1):
        b = w_desc.load([n0, g * BLOCK_K])
        acc += _fp8_group(a_rows, a_ptr, bs_ptr, b, g, offs_m, offs_k, w_block, mask_m, mask_n,
                          k, 0, 0, stride_bsn, BLOCK_M, BLOCK_N, BLOCK_K, True, FP8_MAX, False,
                          SWAP_AB, EXACT_DOT)
    if SWAP_AB:
        acc = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
    _write_tile(acc, c_ptr, bias_ptr, part_ptr, count_ptr, offs_m, offs_n, mask_m, mask_n, n,
                stride_cm, stride_part, BLOCK_M, BLOCK_N, SPLIT_K, HAS_BIAS)


@triton.jit
def _program_tile(a_ptr, m, n, k, groups_per_split, stride_am, SCALE_BN: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """This program's (m block, n block, K split) of the GEMM: row / column offsets and masks,
    the K offsets of a group, its activation rows, each output column's weight scale row, and
    its K groups [g0, g1)."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    a_rows = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am
    g0 = tl.program_id(2) * groups_per_split
    g1 = tl.minimum(g0 + groups_per_split, tl.cdiv(k, BLOCK_K))
    return (offs_m, offs_n, offs_m < m, offs_n < n, tl.arange(0, BLOCK_K), a_rows,
            offs_n // SCALE_BN, g0, g1)


@triton.jit
def _write_tile(acc, c_ptr, bias_ptr, part_ptr, count_ptr, offs_m, offs_n, mask_m, mask_n, n,
                stride_cm, stride_part, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] (+ bias) into c; under split-K as fp32 partials, which the tile's
    last split to arrive adds in split order."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    mask_c = mask_m[:, None] & mask_n[None, :]
    c = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    else:
        bias = tl.zeros((1, BLOCK_N), dtype=tl.float32)
    if SPLIT_K == 1:
        tl.store(c, (acc + bias).to(c_ptr.dtype.element_ty), mask=mask_c)
    else:  # fp32 partials [SPLIT_K, M, N]; the tile's last split to arrive adds them in order
        part = part_ptr + offs_m.to(tl.int64)[:, None] * n + offs_n[None, :]  # split 0
        tl.store(part + pid_s.to(tl.int64) * stride_part, acc, mask=mask_c)
        tl.debug_barrier()  # every thread's partial is written before the tile's count moves
        tile = count_ptr + pid_m * tl.num_programs(1) + pid_n
        if tl.atomic_add(tile, 1, sem="acq_rel") == SPLIT_K - 1:
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32) + bias
            for _ in range(SPLIT_K):  # .cg: from L2, where the other programs' stores are
                total += tl.load(part, mask=mask_c, other=0.0, cache_modifier=".cg")
                part += stride_part
            tl.store(c, total.to(c_ptr.dtype.element_ty), mask=mask_c)
            tl.atomic_xchg(tile, 0)  # zero again for the next launch


@triton.jit
def _fp8_group(a_rows, as_ptr, bs_ptr, b, g, offs_m, offs_k, w_block, mask_m, mask_n, k,
               stride_asm, stride_asg, stride_bsn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, QUANT_A: tl.constexpr, FP8_MAX: tl.constexpr,
               EXACT_E4M3: tl.constexpr, SWAP_AB: tl.constexpr, EXACT_DOT: tl.constexpr):
    """K group g's scaled product of the activation rows and the weight tile b [BLOCK_N,
    BLOCK_K]: [BLOCK_M, BLOCK_N], or its transpose under SWAP_AB."""
    kk = g * BLOCK_K + offs_k
    a = tl.load(a_rows + kk[None, :], mask=mask_m[:, None] & (kk < k)[None, :], other=0.0)
    if QUANT_A:  # float activations: this group's e4m3 values and row scales, here
        q, a_s = _quant_group(a.to(tl.float32), FP8_MAX, EXACT_E4M3)
        a = q.to(b.dtype)
    else:
        a_s = tl.load(as_ptr + offs_m * stride_asm + g * stride_asg, mask=mask_m, other=0.0)
    b_s = tl.load(bs_ptr + w_block * stride_bsn + g, mask=mask_n, other=0.0)  # [BN]
    if SWAP_AB:  # one return: Triton's frontend types every return of a function alike
        part = fp8_dot(b, tl.trans(a), EXACT_DOT) * b_s[:, None] * a_s[None, :]
    else:
        part = fp8_dot(a, tl.trans(b), EXACT_DOT) * a_s[:, None] * b_s[None, :]
    return part


@triton.jit
def fp8_dot(a, b, EXACT: tl.constexpr):
    """a @ b of e4m3 tiles into float32; EXACT: through bf16 operands (module's EXACT_DOT)."""
    if EXACT:
        r = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    else:
        r = tl.dot(a, b)
    return r
