"""Small-M dense GEMV: out [M, N] = x [M, K] @ w [N, K]^T (+ bias) for M <= GEMV_MAX_M.

Why: at decode batch 1 a linear layer is a weight stream, and cuBLAS' M=1 GEMMs leave bandwidth
unused. Here each program owns BLOCK_N rows of w, reads them once in [BLOCK_N, BLOCK_K] tiles
(16-byte loads along the contiguous K) and multiplies every tile with all M rows of x, summing in
float32 on the CUDA cores (no tl.dot: its 16-row minimum would waste 15/16 of the math).

H200, bf16, in a CUDA graph with cold weights (bench.small_ops), µs cuBLAS -> GEMV at M=1:
qkv 2048->5120 8.10 -> 7.81, o_proj 4096->2048 8.57 -> 8.16, router 2048->128 4.81 -> 1.84,
lm_head 2048->151936 149.9 -> 141.3 (4.4 TB/s). At M=2 qkv is 0.81x cuBLAS, at M=4 0.55x, at
M=8 0.33x: one cross-thread sum per row per K step makes it compute-bound, so `Linear` takes it
at LINEAR_MAX_M rows only (TritonOps.linear); the kernel itself is correct up to GEMV_MAX_M.

Launch geometry from N and K only, never M, so a row's result is the same at every M:
- BLOCK_N: the largest power of two <= 16 that still gives TARGET_PROGRAMS programs (about 4 per
  SM of a 132-SM GPU, all resident at once), 1 where N is small (the router's 128 rows);
- BLOCK_K: TILE_ELEMS / BLOCK_N (about 8 KB in flight per program per step), at least 128 and at
  most K rounded up to a power of two (the router reads each row in one step).
No split-K: a small N with a large K (2048->128) still gets N programs with the whole row in one
or two tiles, so every weight byte is requested at once; splitting would add an fp32 pass.

Weight-only FP8 (W8A16, `gemv_fp8`, `_gemv_fp8_kernel`): e4m3 weights with DeepSeek's block
scales, the activations as they are (not quantized). Why: the FP8 GEMMs (fp8.py) quantize
x and run tl.dot on 16-row tiles, far from the weight stream's bandwidth at one row, while here
the weight bytes halve and nothing else changes. Each K step is a [BLOCK_N, G, SUB] tile, SUB =
min(BLOCK_K, the block's bk) columns per group, so every group lies in one scale block: a step
loads G scales (the program's rows share one scale row: BLOCK_N divides bn) and folds them into
the [G, SUB] x slice, with no per-column gather. At one row the products accumulate per lane and
are reduced once after the loop (at more rows, per step and row). An e4m3 element costs more
instructions than a bf16 one (the conversion), at half the bytes: the FP8 GEMV runs nearer the
issue limit, which is why these cuts matter to it and not to the bf16 one. Measured (H200): the
large DeepSeek-V3 weights stream at ~2.4-2.9 TB/s against the bf16 GEMV's ~3.5-4.0; loading the
next step's tile before this step's math (register double-buffering) was no faster, and neither
was widening e4m3 by integer ops instead of Triton's cast (the byte placed in a float32's bits by
shifts and a mask, 2^120 folded into the scales): 7168 -> 36864 took 100.4 µs with int8 loads
sign-extended and 94.1 with int32 words split four ways, against 88.7-89.1 for the cast, and the
batch-1 DeepSeek-V3 cut fell from 441 to 382-386 tok/s (H200, 2026-12-03). Summing each thread's
16 columns every step (a 16x smaller accumulator, for more loads in flight) was slower too: 104.0
against 89.0 µs on 7168 -> 36864, 139.2 against 123.1 µs on the 8 experts, 389 tok/s.

Graph-safe: one launch, shapes from static sizes, no host sync.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from moeserve.kernels.fp8_format import FP8, FP8_BLOCK, Block, as_block, scale_shape
from moeserve.kernels.triton.pdl import launch_kwargs, pdl_wait

GEMV_MAX_M = 8  # rows the kernel takes: each weight element costs M fp32 FMAs
LINEAR_MAX_M = 1  # rows at which it beats cuBLAS (H200, module docstring): Linear's limit
TARGET_PROGRAMS = 512  # ~4 programs per SM on a 132-SM H200: enough loads in flight for HBM
TILE_ELEMS = 4096  # weight elements a program loads per K step (8 KB in 16-bit)
FP8_TILE_ELEMS = 2 * TILE_ELEMS  # the same 8 KB in e4m3
# Large e4m3 weights (DeepSeek-V3's dense gate_up / down and o_proj, >= 64M elements): 32 rows,
# 16K-element steps, 8 warps. H200, two device calls, do_bench µs default -> this: 7168->36864
# 92.7 -> 89.4 / 92.3 -> 89.8, 18432->7168 55.1 -> 52.9 / 55.3 -> 53.2, 16384->7168 50.7 -> 47.7
# in one call (in the other the default was the sweep's best, 50.0); not better on smaller ones.
FP8_WIDE_MIN_ELEMS = 64 << 20
FP8_WIDE_ROWS = 32
MIN_BLOCK_K = 128  # a warp's 16-byte loads cover 256 (fp32: 512) contiguous bytes at least
GEMV_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class GemvConfig(NamedTuple):
    block_n: int
    block_k: int
    num_warps: int = 4


def block_n_for(n: int, groups: int = 1, most: int = 16, programs: int = TARGET_PROGRAMS) -> int:
    """Largest power of two <= `most` such that groups * cdiv(n, block_n) stays >= `programs`
    (1 when even that is fewer): rows of w per program."""
    per = max(1, groups * n // programs)
    return min(most, 1 << (per.bit_length() - 1))


def block_k_for(k: int, rows: int, budget: int = TILE_ELEMS) -> int:
    """K step for a program loading `rows` weight rows per step: budget / rows elements, within
    [MIN_BLOCK_K, next power of two of k]."""
    return max(MIN_BLOCK_K, min(triton.next_power_of_2(k), budget // rows))


def interpreter_block(size: int, most: int) -> int:
    """A block over `size` for Triton's interpreter, which runs programs one by one at ~10 ms
    each: the fewest programs and steps (a whole tile costs it about what one row does)."""
    return min(most, triton.next_power_of_2(size))


def gemv_config(n: int, k: int, device: torch.device) -> GemvConfig:
    if device.type != "cuda":
        return GemvConfig(interpreter_block(n, 64), interpreter_block(k, 1024))
    block_n = block_n_for(n)
    return GemvConfig(block_n, block_k_for(k, block_n))


def gemv_fp8_config(n: int, k: int, block: Block, device: torch.device) -> GemvConfig:
    """`gemv_config` for e4m3 weights: BLOCK_N also at most the block's bn (rows of a program
    share a scale row), K steps of FP8_TILE_ELEMS / BLOCK_N elements. Weights of at least
    FP8_WIDE_MIN_ELEMS elements with N >= 132 * FP8_WIDE_ROWS: FP8_WIDE (twice the step on
    twice the warps)."""
    if device.type != "cuda":
        return GemvConfig(interpreter_block(n, min(64, block[0])), interpreter_block(k, 1024))
    if n * k >= FP8_WIDE_MIN_ELEMS and n >= 132 * FP8_WIDE_ROWS and block[0] % FP8_WIDE_ROWS == 0:
        return GemvConfig(FP8_WIDE_ROWS, block_k_for(k, FP8_WIDE_ROWS, 2 * FP8_TILE_ELEMS), 8)
    block_n = block_n_for(n, most=min(16, block[0]))
    return GemvConfig(block_n, block_k_for(k, block_n, FP8_TILE_ELEMS))


def gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
         config: GemvConfig | None = None, pdl: bool = False,
         out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [M, K] (unit column stride) @ w [N, K]^T (unit column stride) + bias [N] → [M, N] in
    out_dtype (default x.dtype), float32 accumulation; M <= GEMV_MAX_M. x and w may differ in
    dtype (both are widened to float32: a bf16 x on a float32 router weight is x.float() @ w^T).
    `config`: launch geometry (default `gemv_config`). `pdl`: a programmatic dependent launch
    (pdl.py) whose first weight tile loads before the wait, so w must be a parameter
    nothing writes during the forward."""
    m, k = x.shape
    n = w.shape[0]
    _check_shapes("gemv", x, w, bias)
    out = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    cfg = config or gemv_config(n, k, x.device)
    _launch(x, w, None, bias, out, cfg, (1, 1), pdl)
    return out


def gemv_fp8(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
             bias: torch.Tensor | None = None, block: int | Block = FP8_BLOCK,
             config: GemvConfig | None = None, out: torch.Tensor | None = None,
             pdl: bool = False) -> torch.Tensor:
    """Weight-only FP8: x [M, K] (bf16/fp16/fp32 as it is, unit column stride) @ (w * w_scale)^T
    + bias [N] → [M, N] in x.dtype, float32 accumulation; M <= GEMV_MAX_M. w [N, K] e4m3 (unit
    column stride), w_scale [ceil(N/bn), ceil(K/bk)] float32 (real = stored * scale, partial
    edge blocks allowed). `out`: write into this [M, N] view (unit column stride). `pdl`: as in
    `gemv`."""
    m, k = x.shape
    n = w.shape[0]
    bn, bk = as_block(block)
    _check_shapes("gemv_fp8", x, w, bias)
    if w.dtype != FP8 or tuple(w_scale.shape) != scale_shape(n, k, (bn, bk)):
        raise ValueError(f"gemv_fp8: w {tuple(w.shape)} {w.dtype}, scale "
                         f"{tuple(w_scale.shape)} for blocks {[bn, bk]}")
    assert w_scale.stride(1) == 1 and w_scale.dtype == torch.float32
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    assert out.shape == (m, n) and out.stride(1) == 1
    if m == 0 or n == 0:
        return out
    cfg = config or gemv_fp8_config(n, k, (bn, bk), x.device)
    if bn % cfg.block_n:
        raise ValueError(f"gemv_fp8: block_n {cfg.block_n} must divide the scale block {bn}")
    _launch(x, w, w_scale, bias, out, cfg, (bn, bk), pdl)
    return out


def _check_shapes(name: str, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None):
    if x.shape[0] > GEMV_MAX_M or w.shape[1] != x.shape[1]:
        raise ValueError(f"{name}: x {tuple(x.shape)}, w {tuple(w.shape)} (M <= {GEMV_MAX_M})")
    assert x.stride(1) == 1 and w.stride(1) == 1 and (bias is None or bias.is_contiguous())


def _launch(x, w, w_scale, bias, out, cfg: GemvConfig, block: Block, pdl: bool) -> None:
    """One launch over cdiv(N, block_n) programs; w_scale None: a float weight."""
    (m, k), n = x.shape, w.shape[0]
    grid = (triton.cdiv(n, cfg.block_n),)
    common = dict(M=m, BLOCK_M=triton.next_power_of_2(m), BLOCK_N=cfg.block_n,
                  HAS_BIAS=bias is not None, num_warps=cfg.num_warps, **launch_kwargs(pdl))
    b = out if bias is None else bias
    if w_scale is None:
        _gemv_kernel[grid](x, w, b, out, n, k, x.stride(0), w.stride(0), out.stride(0),
                           BLOCK_K=cfg.block_k, EVEN_K=k % cfg.block_k == 0, **common)
        return
    sub = min(cfg.block_k, block[1])  # a group's columns lie in one scale block
    _gemv_fp8_kernel[grid](x, w, w_scale, b, out, n, k, x.stride(0), w.stride(0),
                           w_scale.stride(0), out.stride(0), GROUPS=cfg.block_k // sub, SUB=sub,
                           EVEN_K=k % cfg.block_k == 0, SCALE_BN=block[0], SCALE_BK=block[1],
                           **common)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, out_ptr, N, K, stride_xm, stride_wn, stride_om,
                 M: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                 USE_PDL: tl.constexpr):
    """Program n-block: each [BLOCK_N, BLOCK_K] tile of w is loaded once and dotted with the M
    rows of x (statically unrolled), partial sums per step added into acc [BLOCK_M, BLOCK_N].
    The first tile loads before the PDL wait (weights only)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows = tl.arange(0, BLOCK_M)
    # rows past N wrap to valid ones (no mask along N); their results are never stored
    w_ptrs = w_ptr + (offs_n % N).to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    w = _load_tile(w_ptrs, offs_k[None, :], K, EVEN_K)
    pdl_wait(USE_PDL)
    acc = _gemv_step(tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), w.to(tl.float32), x_ptr,
                     offs_k, rows, K, stride_xm, M, EVEN_K)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        w_ptrs += BLOCK_K
        wk = _load_tile(w_ptrs, offs_k[None, :], K - k0, EVEN_K).to(tl.float32)
        acc = _gemv_step(acc, wk, x_ptr + k0, offs_k, rows, K - k0, stride_xm, M, EVEN_K)
    _store_rows(acc, b_ptr, out_ptr, offs_n, rows, N, stride_om, M, HAS_BIAS)


@triton.jit
def _load_tile(ptrs, offs_k, k_left, EVEN_K: tl.constexpr):
    """A weight tile whose columns offs_k < k_left are real (the rest 0 where K is uneven)."""
    if EVEN_K:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=offs_k < k_left, other=0.0)


@triton.jit
def _gemv_step(acc, w, x_ptr, offs_k, rows, k_left, stride_xm, M: tl.constexpr,
               EVEN_K: tl.constexpr):
    """acc[m] += w [BN, BK] . x[m, :BK] for the M rows of x (x_ptr at this step's columns)."""
    for m in tl.static_range(M):
        if EVEN_K:
            xm = tl.load(x_ptr + m * stride_xm + offs_k)
        else:
            xm = tl.load(x_ptr + m * stride_xm + offs_k, mask=offs_k < k_left, other=0.0)
        part = tl.sum(w * xm.to(tl.float32)[None, :], axis=1)  # [BN]
        acc = tl.where(rows[:, None] == m, acc + part[None, :], acc)
    return acc


@triton.jit
def _gemv_fp8_kernel(x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, N, K, stride_xm, stride_wn, stride_sn,
                     stride_om, M: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     GROUPS: tl.constexpr, SUB: tl.constexpr, EVEN_K: tl.constexpr,
                     HAS_BIAS: tl.constexpr, SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr,
                     USE_PDL: tl.constexpr):
    """Program n-block of e4m3 w [N, K] with scales s [ceil(N/SCALE_BN), ceil(K/SCALE_BK)]:
    K steps of GROUPS x SUB columns, each group inside one scale block (SUB <= SCALE_BK, both
    powers of two); this program's scale row is the one of its first row. The first tile loads
    before the PDL wait (weights only)."""
    BLOCK_K: tl.constexpr = GROUPS * SUB
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_g = tl.arange(0, GROUPS)
    offs_k = offs_g[:, None] * SUB + tl.arange(0, SUB)[None, :]  # [G, SUB]
    rows = tl.arange(0, BLOCK_M)
    # rows past N wrap to valid ones (no mask along N); their results are never stored
    w_ptrs = (w_ptr + (offs_n % N).to(tl.int64)[:, None, None] * stride_wn
              + offs_k[None, :, :])  # [BN, G, SUB]
    s_row = s_ptr + (tl.program_id(0) * BLOCK_N // SCALE_BN) * stride_sn
    if M == 1:  # per-lane products, reduced once after the loop
        acc = tl.zeros([BLOCK_N, GROUPS, SUB], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    w = _load_tile(w_ptrs, offs_k[None, :, :], K, EVEN_K)
    pdl_wait(USE_PDL)
    acc = _fp8_step(acc, w, s_row, x_ptr, 0, offs_g, offs_k, rows, K, stride_xm, M, SUB,
                    SCALE_BK, EVEN_K)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        w_ptrs += BLOCK_K
        w = _load_tile(w_ptrs, offs_k[None, :, :], K - k0, EVEN_K)
        acc = _fp8_step(acc, w, s_row, x_ptr, k0, offs_g, offs_k, rows, K, stride_xm, M, SUB,
                        SCALE_BK, EVEN_K)
    if M == 1:
        acc = tl.sum(tl.sum(acc, axis=2), axis=1)[None, :]  # [1, BN]
    _store_rows(acc, b_ptr, out_ptr, offs_n, rows, N, stride_om, M, HAS_BIAS)


@triton.jit
def _fp8_step(acc, w, s_row, x_ptr, k0, offs_g, offs_k, rows, K, stride_xm, M: tl.constexpr,
              SUB: tl.constexpr, SCALE_BK: tl.constexpr, EVEN_K: tl.constexpr):
    """One K step of the FP8 GEMV: w [BN, G, SUB] e4m3 at columns k0..; the groups' block
    scales folded into x."""
    w = w.to(tl.float32)
    # [G]: each group's block scale (groups past K: 0, their x and w are masked to 0 too)
    s = tl.load(s_row + (k0 + offs_g * SUB) // SCALE_BK, mask=offs_g * SUB < K - k0, other=0.0)
    for m in tl.static_range(M):
        if EVEN_K:
            xm = tl.load(x_ptr + m * stride_xm + k0 + offs_k)
        else:
            xm = tl.load(x_ptr + m * stride_xm + k0 + offs_k, mask=offs_k < K - k0, other=0.0)
        xs = (xm.to(tl.float32) * s[:, None])[None, :, :]  # the scales folded into x
        if M == 1:
            acc += w * xs
        else:
            part = tl.sum(tl.sum(w * xs, axis=2), axis=1)  # [BN]
            acc = tl.where(rows[:, None] == m, acc + part[None, :], acc)
    return acc


@triton.jit
def _store_rows(acc, b_ptr, out_ptr, offs_n, rows, N, stride_om, M: tl.constexpr,
                HAS_BIAS: tl.constexpr):
    """out[rows < M, offs_n < N] = acc [BLOCK_M, BLOCK_N] (+ bias), in out's dtype."""
    n_ok = offs_n < N
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(rows < M)[:, None] & n_ok[None, :])
