"""Linear layers whose weights stay in DeepSeek's block FP8 (e4m3 + a float32 scale per block).

`weight` [N, K] float8_e4m3fn and `weight_scale_inv` [ceil(N/bn), ceil(K/bk)] float32 are named
as in the checkpoints, so FP8 tensors load by name; a float tensor loaded into them is quantized
into the same blocks (kernels/fp8_format.py, `model.quantization=fp8`). Two forward paths:
- "triton": activations quantized per token and group of bk channels, then a block-scaled FP8
  GEMM with fp32 accumulation (at one row: weight-only, x as it is); `fp8_linear` picks the
  kernel by the input's token count M;
- "torch": the reference, dequantize the weight and matmul in the activation dtype (no activation
  quantization); CPU runs it, and it is selectable anywhere by setting `backend`;
- "emulate": the Triton path's arithmetic in float64 (layers/fp8_emulation.py), the yardstick of
  its accuracy (tests and bench/fp8_accuracy.py; no config selects it).

`fp8_linear`'s choice, from static shapes only (no host sync, so CUDA graphs capture it):
- M <= W8A16_MAX_M (decode at batch 1), bf16/fp16/fp32 activations, weights of fewer than
  GEMV_MAX_ELEMS elements: the weight-only FP8 GEMV (kernels/triton/gemv.py `gemv_fp8`), x not
  quantized, the e4m3 tiles dequantized in registers;
- M <= FUSED_MAX_M (decode, and batch 1 on the large weights): one Triton launch that
  quantizes x inside the GEMM, K split over enough programs to stream the weights
  (kernels/triton/fp8.py; at one row the weight tile is tl.dot's A operand). At one row it streams
  DeepSeek-V3's large weights faster than the GEMV (H200, CUDA graphs, cold weights, µs:
  7168 -> 36864 73.5 against 79.3, 18432 -> 7168 42.9 against 44.2, 16384 -> 7168 38.0 against
  39.6), the GEMV the rest (1536 -> 24576 14.3 against 15.4, 7168 -> 4096 11.5 against 13.4):
  the tensor-core tiles leave the CUDA cores less to do per byte, but need many rows to pay;
- M >= SCALED_MM_MIN_M: torch._scaled_mm with 1x128 activation / 128x128 weight scales, where a
  probe at first use on this CUDA device accepted it (`scaled_mm_layout`), for 128 x 128 blocks,
  K a multiple of 512 and N of 16, contiguous weights; the quantization kernel writes the
  activation scales in the layout the probe found;
- otherwise: the quantization kernel, then the Triton GEMM on the quantized activations.
With backend "deep_gemm" (`model.fp8_gemm=deep_gemm`, where `deep_gemm` imports) the last two
run DeepGEMM instead wherever it takes the shape (kernels/deepgemm_linear.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from moeserve.kernels.deepgemm_linear import deep_gemm_linear, deep_gemm_supports
from moeserve.kernels.fp8_format import (
    FP8,
    FP8_BLOCK,
    Block,
    as_block,
    check_block,
    dequantize_fp8_blocks,
    quantize_fp8_blocks,
    scale_shape,
)
from moeserve.layers.fp8_paths import (  # noqa: F401
    FUSED_MAX_M,
    GEMV_MAX_ELEMS,
    SCALED_MM_MIN_M,
    W8A16_DTYPES,
    W8A16_MAX_M,
    uses_w8a16_gemv,
)

logger = logging.getLogger(__name__)

# deep_gemm: triton with DeepGEMM at large M; emulate: the triton path in float64
FP8_BACKENDS = ("triton", "deep_gemm", "torch", "emulate")


@dataclass(frozen=True)
class ScaledMMLayout:
    """How torch._scaled_mm takes DeepSeek's scales here: activation scales [M, K/128]
    column-major (strides (1, M)) or row-major; weight scales as the view w_scale.t() or a
    contiguous copy of it; M padded with zero rows to a multiple of `row_multiple`."""

    a_col_major: bool
    b_contiguous: bool
    row_multiple: int = 1
    dtype: torch.dtype = torch.bfloat16  # the output dtype it was probed with


# tried in this order (copies last), each with M padded to a multiple of 1, then 4, then 16
SCALED_MM_LAYOUTS = (ScaledMMLayout(True, False), ScaledMMLayout(True, True),
                     ScaledMMLayout(False, False), ScaledMMLayout(False, True))
PROBE_K, PROBE_N, PROBE_MS = 512, 320, (37, 64)  # N: two full 128-row blocks and a partial one
_probed: dict[torch.device, ScaledMMLayout | None] = {}


def scaled_mm_layout(device: torch.device) -> ScaledMMLayout | None:
    """The working torch._scaled_mm layout on this CUDA device, probed once per process at first
    use (not while a CUDA graph is being captured: then None, and the next eager call probes);
    None off CUDA or where every layout raised or disagreed with the reference."""
    if device.type != "cuda":
        return None
    device = torch.device("cuda", torch.cuda.current_device() if device.index is None
                          else device.index)
    if device not in _probed:
        if torch.cuda.is_current_stream_capturing():
            return None
        layout, why = probe_scaled_mm(device)
        _probed[device] = layout
        if layout is None:
            logger.info("FP8 linear on %s: Triton GEMMs at every M (torch._scaled_mm with "
                        "1x128 / 128x128 scales: %s)", device, why)
        else:
            logger.info("FP8 linear on %s: torch._scaled_mm for M >= %d (%s activation "
                        "scales, weight scales %s, M padded to %d), Triton below", device,
                        SCALED_MM_MIN_M, "column-major" if layout.a_col_major else "row-major",
                        "copied" if layout.b_contiguous else "as stored", layout.row_multiple)
    return _probed[device]


def probe_scaled_mm(device: torch.device, dtype: torch.dtype = torch.bfloat16
                    ) -> tuple[ScaledMMLayout | None, str]:
    """(the first layout with which `scaled_mm_linear` runs and matches the float32 reference
    on the dequantized operands within 1e-2 at every M of PROBE_MS, or None; why not)."""
    g = torch.Generator().manual_seed(0)
    w_q, w_s = quantize_fp8_blocks((torch.randn(PROBE_N, PROBE_K, generator=g) * 0.05).to(device))
    w = dequantize_fp8_blocks(w_q, w_s)
    xs = [torch.randn(m, PROBE_K, generator=g).to(device, dtype) for m in PROBE_MS]
    why = "no layout matched the reference"
    for multiple in (1, 4, 16):
        for layout in SCALED_MM_LAYOUTS:
            layout = replace(layout, row_multiple=multiple, dtype=dtype)
            try:
                errs = [_rel_err(scaled_mm_linear(x, w_q, w_s, layout), x, w) for x in xs]
            except Exception as e:  # noqa: BLE001 - any refusal means "not this layout"
                why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
                continue
            if all(err < 1e-2 for err in errs):
                return layout, ""
            why = f"{layout}: relative error {max(errs):.3g} against the reference"
    return None, why


def _rel_err(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> float:
    from moeserve.kernels.triton.fp8 import quant_fp8_per_token_group

    x_q, x_s = quant_fp8_per_token_group(x)
    ref = (x_q.float() * x_s.repeat_interleave(FP8_BLOCK, 1)[:, : x.shape[1]]) @ w.t()
    if out.shape != ref.shape:
        return float("inf")
    return float((out.float() - ref).norm() / ref.norm())  # NaN compares as not < 1e-2


def scaled_mm_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                     layout: ScaledMMLayout) -> torch.Tensor:
    """x [M, K] → [M, N] in layout.dtype by torch._scaled_mm; the activation scales come from
    the quantization kernel in the layout's strides, padded rows are zeros."""
    from moeserve.kernels.triton.fp8 import quant_fp8_per_token_group

    m = x.shape[0]
    rows = -(-m // layout.row_multiple) * layout.row_multiple
    x_q, x_s = quant_fp8_per_token_group(x, FP8_BLOCK, col_major=layout.a_col_major, rows=rows)
    s_w = w_scale.t().contiguous() if layout.b_contiguous else w_scale.t()
    return torch._scaled_mm(x_q, w.t(), scale_a=x_s, scale_b=s_w, out_dtype=layout.dtype)[:m]


def fp8_gemm_path(m: int, n: int, k: int, block: Block, dtype: torch.dtype,
                  device: torch.device) -> str:
    """"gemv" | "fused" | "scaled_mm" | "triton" for [M, K] x [N, K]^T: static shapes and the
    cached probe only (the probe runs at the first eligible call)."""
    if uses_w8a16_gemv(m, n, k, dtype):
        return "gemv"
    if m <= FUSED_MAX_M:
        return "fused"
    if m >= SCALED_MM_MIN_M and block == (128, 128) and k % 512 == 0 and n % 16 == 0:
        layout = scaled_mm_layout(device)
        if layout is not None and layout.dtype == dtype:
            return "scaled_mm"
    return "triton"


def fp8_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
               bias: torch.Tensor | None = None, block: int | Block = FP8_BLOCK,
               pdl: bool = False, deep_gemm: bool = False) -> torch.Tensor:
    """A linear layer on block-FP8 weights: x [..., K] → [..., N] in x.dtype (module docstring:
    which GEMM runs). `pdl`: the GEMV and fused paths as programmatic dependent launches
    (kernels/triton/pdl.py); the other paths launch plainly. `deep_gemm`: DeepGEMM instead of
    torch._scaled_mm / the Triton GEMM where the shape fits (kernels/deepgemm_linear.py)."""
    from moeserve.kernels.triton import fp8 as kernels  # imports Triton

    x2 = x.reshape(-1, x.shape[-1])  # [M, K]
    block = as_block(block)
    path = fp8_gemm_path(x2.shape[0], w.shape[0], x2.shape[1], block, x.dtype, x.device)
    if path == "scaled_mm" and (bias is not None or not (w.is_contiguous()
                                                         and w_scale.is_contiguous())):
        # torch._scaled_mm reads w.t() as column-major [K, N]; a bias added to its bf16 output
        # would round twice (2.9e-3 from the emulation on an H100), the Triton epilogue once
        path = "triton"
    if deep_gemm and path in ("scaled_mm", "triton") and w.is_contiguous() \
            and deep_gemm_supports(w.shape[0], x2.shape[1], block, x.dtype):
        path = "deep_gemm"
    if path == "deep_gemm":
        out = deep_gemm_linear(x2 if x2.is_contiguous() else x2.contiguous(), w, w_scale)
        if bias is not None:
            out += bias
    elif path == "gemv":
        from moeserve.kernels.triton.gemv import gemv_fp8

        x2 = x2 if x2.stride(1) == 1 else x2.contiguous()
        out = gemv_fp8(x2, w, w_scale, bias, block, pdl=pdl)
    elif path == "fused":
        out = kernels.fp8_quant_matmul(x2, w, w_scale, block, bias=bias, pdl=pdl)
    elif path == "scaled_mm":
        out = scaled_mm_linear(x2, w, w_scale, scaled_mm_layout(x.device))
    else:
        x_q, x_s = kernels.quant_fp8_per_token_group(x2, block[1])
        out = kernels.fp8_block_matmul(x_q, x_s, w, w_scale, x.dtype, block, bias=bias)
    return out.view(*x.shape[:-1], w.shape[0])


def fp8_parameter(*shape: int, device=None) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=FP8, device=device), requires_grad=False)


def scale_parameter(*shape: int, device=None) -> nn.Parameter:
    return nn.Parameter(torch.ones(shape, dtype=torch.float32, device=device), requires_grad=False)


class Fp8Linear(nn.Module):
    """y = x @ dequant(weight)^T (+ bias): x [..., K] → [..., N] in x's dtype."""

    gpu_ops: Any = None  # TritonOps on CUDA models: its `pdl` flag applies to the GEMV path

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
        if self.backend == "emulate":
            from moeserve.layers.fp8_emulation import emulate_fp8_linear

            return emulate_fp8_linear(self, x)
        return fp8_linear(x, self.weight, self.weight_scale_inv, self.bias, self.block, self.pdl,
                          deep_gemm=self.backend == "deep_gemm")

    @property
    def pdl(self) -> bool:
        """Launch the GEMV and fused paths with PDL: the model's flag, where CUDA ops were
        attached."""
        return self.gpu_ops is not None and self.gpu_ops.pdl


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
        if self.backend in ("torch", "emulate") or self.aligned:
            return super().forward(x)
        from moeserve.kernels.triton import fp8 as kernels  # imports Triton
        from moeserve.kernels.triton.gemv import gemv_fp8

        x2 = x.reshape(-1, x.shape[-1])  # [T, K]
        out = torch.empty((x2.shape[0], self.out_features), dtype=x.dtype, device=x.device)
        m, k = x2.shape
        if m <= W8A16_MAX_M and x2.stride(1) != 1:
            x2 = x2.contiguous()
        if m > FUSED_MAX_M:  # quantized once for all shards
            x_q, x_s = kernels.quant_fp8_per_token_group(x2, self.block[1])
        for (start, size, _, _), (w, s) in zip(self.shards.values(), self._shard_views()):
            cols = out[:, start : start + size]
            bias = None if self.bias is None else self.bias[start : start + size]
            path = fp8_gemm_path(m, size, k, self.block, x.dtype, x.device)
            if path == "gemv":
                gemv_fp8(x2, w, s, bias, self.block, out=cols, pdl=self.pdl)
            elif m <= FUSED_MAX_M:
                kernels.fp8_quant_matmul(x2, w, s, self.block, out=cols, bias=bias,
                                         pdl=self.pdl)
            else:
                kernels.fp8_block_matmul(x_q, x_s, w, s, block=self.block, out=cols, bias=bias)
        return out.view(*x.shape[:-1], self.out_features)
