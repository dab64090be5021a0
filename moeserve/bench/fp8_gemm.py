"""`python -m moeserve.bench.fp8_gemm`: block-scaled FP8 GEMM TFLOP/s against bf16 `torch.matmul`
on DeepSeek-V3's linear shapes, on one CUDA GPU.

Rows: M tokens x (K -> N). Columns: bf16 x @ w^T; the FP8 linear as the model runs it (an
`Fp8Linear`: its path by M, layers/fp8_linear.py, is the `path` column: `gemv` = the weight-only
FP8 GEMV at one row (x not quantized), `fused` = one Triton launch quantizing x inside the GEMM,
`scaled_mm` = the quantization kernel + torch._scaled_mm, `triton` = the quantization kernel +
the Triton GEMM); the Triton GEMM alone on pre-quantized activations; `torch._scaled_mm` alone
with the same 1x128 / 128x128 scales where this torch supports them ("-" otherwise); the FP8
linear's speedup over bf16; and, for the fastest FP8 column, the weight read rate as a share of
the copy bandwidth (what bounds small M). The bf16 peak is measured on an 8192^3 matmul. Times
are do_bench medians (L2 flushed between runs: a layer's weights are cold). `--sweep` also tries
a few launch configs per shape (of the fused kernel at M <= 16, of the GEMM above) and prints the
best.

A second table, at M = 1 (decode batch 1), on the FP8 linears the model runs at one row (merged
gate_up as one matrix): µs and weight GB/s (weight + scale bytes over the time) of bf16 `x @ w^T`
(cuBLAS), the bf16 GEMV (kernels/triton/gemv.py), the fused FP8 kernel at its one-row config
(activation quantization + swapped tl.dot) and the W8A16 GEMV (`gemv_fp8`), each timed in a CUDA
graph over weight copies that together exceed L2 (no host launch time, cold weights); then the
path Fp8Linear takes at one row and its speedup over the bf16 GEMV. Then DeepSeek-V3's routed
experts at one token (`fused_moe_small`, 8 of 32 experts, H 7168, I 2048), bf16 against e4m3
weights (GB/s of the 8 experts' bytes). `--gemv-sweep` also tries launch configs of the W8A16
kernels (GemvConfig: rows, K step, warps) and of the fused kernel at one row (tile width, K
split, stages) and prints the best beside the default.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import triton

from moeserve.kernels.deepgemm_linear import (deep_gemm_linear, deep_gemm_module,
                                              deep_gemm_supports)
from moeserve.kernels.triton.fp8 import (GemmConfig, fp8_block_matmul, fp8_quant_matmul,
                                         fused_config, gemm_config, quant_fp8_per_token_group)
from moeserve.kernels.fp8_format import dequantize_fp8_blocks, quantize_fp8_blocks
from moeserve.kernels.triton.fused_moe_small import fused_moe_small, small_moe_config
from moeserve.kernels.triton.gemv import GemvConfig, gemv, gemv_fp8, gemv_fp8_config
from moeserve.layers.fp8_linear import FUSED_MAX_M, Fp8Linear, fp8_gemm_path, scaled_mm_layout

# (K, N) of DeepSeek-V3: dense MLP up (gate or up), q_a, q_b, kv_a, o_proj, dense MLP down
SHAPES = [(7168, 18432), (7168, 1536), (1536, 24576), (7168, 576), (16384, 7168), (18432, 7168)]
# the M = 1 table: dense gate_up (merged), dense down, q_a, kv_a, their merge as the model runs
# it (fused_qkv_a_proj), q_b, o_proj, shared expert gate_up (merged) and down, the LM head
# (FP8 with model.fp8_lm_head)
GEMV_SHAPES = [(7168, 36864), (18432, 7168), (7168, 1536), (7168, 576), (7168, 2112),
               (1536, 24576), (16384, 7168), (7168, 4096), (2048, 7168), (7168, 129280)]
MOE_SHAPE = (32, 7168, 2048, 8)  # experts made (8 touched), H, I, top-k: DeepSeek-V3's
TOKENS = (1, 16, 64, 256, 4096)
SWEEP = [GemmConfig(16, 64), GemmConfig(16, 128, num_stages=4), GemmConfig(32, 128),
         GemmConfig(64, 128, num_warps=8), GemmConfig(128, 128, num_warps=8, num_stages=4),
         GemmConfig(128, 256, num_warps=8)]
FUSED_SWEEP = [GemmConfig(16, bn, split, 4, 4) for bn in (32, 64, 128) for split in (1, 4, 16)]


def _us(fn, rep: int = 50) -> float:
    import triton.testing

    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median") * 1e3


def bf16_peak_tflops(n: int = 8192) -> float:
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    return 2 * n**3 / (_us(lambda: a @ b) * 1e-6) / 1e12


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * nbytes / (_us(lambda: dst.copy_(src)) * 1e-6)


def scaled_mm_fn(x_q, x_s, w_q, w_s, ref: torch.Tensor):
    """torch._scaled_mm on block scales, or None where this torch/GPU refuses them or gives a
    different result (several scale layouts are tried)."""
    b = w_q.t()  # [K, N] column-major
    x_s_cm = x_s.t().contiguous().t()  # column-major activation scales
    layouts = [(x_s_cm, w_s.t()), (x_s_cm, w_s.t().contiguous()), (x_s, w_s.t().contiguous())]
    for sa, sb in layouts:
        try:
            out = torch._scaled_mm(x_q, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
        except (RuntimeError, TypeError, ValueError):
            continue
        if float((out.float() - ref).norm() / ref.norm()) < 2e-2:
            return lambda sa=sa, sb=sb: torch._scaled_mm(x_q, b, scale_a=sa, scale_b=sb,
                                                         out_dtype=torch.bfloat16)
    return None


def bench_shape(m: int, k: int, n: int, bw: float, sweep: bool) -> str:
    g = torch.Generator(device="cuda").manual_seed(m + k + n)
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    w_q, w_s = quantize_fp8_blocks(w)
    lin = Fp8Linear(k, n, device="cuda")
    lin.weight.data.copy_(w_q)
    lin.weight_scale_inv.data.copy_(w_s)
    x_q, x_s = quant_fp8_per_token_group(x)
    flops = 2 * m * n * k
    t_bf16 = _us(lambda: x @ w.t())
    t_lin = _us(lambda: lin(x))
    path = fp8_gemm_path(m, n, k, (128, 128), x.dtype, x.device)
    t_gemm = _us(lambda: fp8_block_matmul(x_q, x_s, w_q, w_s))
    ref = (x_q.float() * x_s.repeat_interleave(128, 1)[:, :k]) @ dequantize_fp8_blocks(w_q, w_s).t()
    mm = scaled_mm_fn(x_q, x_s, w_q, w_s, ref)
    t_mm = _us(mm) if mm is not None else None
    best = min(t for t in (t_lin, t_gemm, t_mm) if t is not None)
    weight_gbs = (n * k + w_s.numel() * 4) / (best * 1e-6)
    cells = [f"{m:>5}", f"{k:>5} -> {n:<5}", f"{flops / t_bf16 / 1e6:>9.1f}",
             f"{flops / t_lin / 1e6:>9.1f}", f"{path:<9}", f"{flops / t_gemm / 1e6:>9.1f}",
             f"{flops / t_mm / 1e6:>9.1f}" if t_mm else f"{'-':>9}",
             f"{t_bf16 / t_lin:>6.2f}x", f"{100 * weight_gbs / bw:>6.1f}%"]
    line = "| " + " | ".join(cells) + " |"
    if deep_gemm_module() is not None and deep_gemm_supports(n, k, (128, 128), x.dtype):
        t_dg = _us(lambda: deep_gemm_linear(x, w_q, w_s))  # its quantization launch included
        line += f" deep_gemm {flops / t_dg / 1e6:.1f} TFLOP/s ({t_lin / t_dg:.2f}x fp8 lin)"
    if sweep:
        line += " " + _sweep(m, k, n, x, x_q, x_s, w_q, w_s, flops)
    return line


def _sweep(m: int, k: int, n: int, x: torch.Tensor, x_q: torch.Tensor, x_s: torch.Tensor,
           w_q: torch.Tensor, w_s: torch.Tensor, flops: int) -> str:
    """The best launch config: of the fused kernel (M <= 16) or of the GEMM on quantized x."""
    if m <= FUSED_MAX_M:
        default = fused_config(n, k, 128, x.device)
        tried = {c: _us(lambda c=c: fp8_quant_matmul(x, w_q, w_s, config=c))
                 for c in {*FUSED_SWEEP, default}}
    else:
        default = gemm_config(m, n, k, 128, x.device)
        configs = {*SWEEP, *(GemmConfig(c.block_m, c.block_n, s, c.num_warps, c.num_stages)
                             for c in SWEEP[:3] for s in (4, 8))}
        tried = {c: _us(lambda c=c: fp8_block_matmul(x_q, x_s, w_q, w_s, config=c))
                 for c in configs}
    c, t = min(tried.items(), key=lambda kv: kv[1])
    mine = f": {flops / tried[default] / 1e6:.1f}" if default in tried else ""
    return f"best {flops / t / 1e6:.1f} TFLOP/s at {c} (default {default}{mine})"


def _graph_us(make, copies: int, reps: int = 20) -> float:
    """µs per call of make(i)() (i: which of `copies` weight copies), the calls captured in one
    CUDA graph: no host launch time, and the copies together exceed L2, so weights are cold."""
    calls = [make(i) for i in range(copies)]
    for c in calls:
        c()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * copies)


def bench_gemv_shape(k: int, n: int, sweep: bool) -> str:
    """One row of the M = 1 table: µs and weight GB/s per kernel (CUDA graphs over weight copies
    that exceed L2), the path Fp8Linear takes and its speedup over the bf16 GEMV."""
    g = torch.Generator(device="cuda").manual_seed(k + n)
    x = torch.randn(1, k, device="cuda", generator=g).to(torch.bfloat16)
    copies = max(2, min(32, -(-(256 << 20) // (n * k))))
    ws = [(torch.randn(n, k, device="cuda", generator=g) * k**-0.5).to(torch.bfloat16)
          for _ in range(copies)]
    qs = [quantize_fp8_blocks(w) for w in ws]
    fp8_bytes, bf16_bytes = n * k + qs[0][1].numel() * 4, 2 * n * k
    path = fp8_gemm_path(1, n, k, (128, 128), x.dtype, x.device)
    fused = fused_config(n, k, 128, x.device, rows=1)
    times = [(_graph_us(lambda i: lambda: x @ ws[i].t(), copies), bf16_bytes),
             (_graph_us(lambda i: lambda: gemv(x, ws[i]), copies), bf16_bytes),
             (_graph_us(lambda i: lambda: fp8_quant_matmul(x, *qs[i], config=fused), copies),
              fp8_bytes),
             (_graph_us(lambda i: lambda: gemv_fp8(x, *qs[i]), copies), fp8_bytes)]
    cells = [f"{k:>5} -> {n:<5}"]
    cells += [f"{t:>7.2f} {b / (t * 1e-6) / 1e9:>5.0f}" for t, b in times]
    lin = times[3][0] if path == "gemv" else times[2][0]
    cells += [f"{path:<6}", f"{times[1][0] / lin:>6.2f}x"]
    line = "| " + " | ".join(cells) + " |"
    if sweep:
        tried = {c: _graph_us(lambda i, c=c: lambda: gemv_fp8(x, *qs[i], config=c), copies, 5)
                 for c in _gemv_sweep(n, k)}
        c, t = min(tried.items(), key=lambda kv: kv[1])
        line += (f" gemv best {t:.2f} µs {fp8_bytes / (t * 1e-6) / 1e9:.0f} GB/s at {tuple(c)} "
                 f"(default {tuple(gemv_fp8_config(n, k, (128, 128), x.device))});")
        tried = {c: _graph_us(lambda i, c=c: lambda: fp8_quant_matmul(x, *qs[i], config=c),
                              copies, 5) for c in {*_fused_sweep(n, k), fused}}
        c, t = min(tried.items(), key=lambda kv: kv[1])
        line += (f" fused best {t:.2f} µs at (bn {c.block_n}, split {c.split_k}, stages "
                 f"{c.num_stages}, swap {c.swap_ab}, tma {c.tma}); default {tried[fused]:.2f}; "
                 "all (bn/split/stages, s: swapped, t: TMA) "
                 + " ".join(f"{c.block_n}/{c.split_k}/{c.num_stages}{'s' if c.swap_ab else ''}"
                            f"{'t' if c.tma else ''}={t:.1f}"
                            for c, t in sorted(tried.items(), key=lambda kv: kv[1])))
    return line


def _fused_sweep(n: int, k: int) -> set[GemmConfig]:
    """Decode configs of the fused kernel: swapped 64/128-row weight tiles, K split 1-16."""
    groups = -(-k // 128)
    return {GemmConfig(16, bn, split, 4, stages, swap_ab=True, tma=tma) for bn in (64, 128)
            for split in (1, 2, 4, 8, 16) for stages in (3, 4) for tma in (False, True)
            if split <= max(groups // 2, 1)}


def _gemv_sweep(n: int, k: int) -> set[GemvConfig]:
    """W8A16 GEMV configs: 8K-element steps on 4 warps, 16K on 8, over 4-32 rows; and
    one-scale-column steps (K step 128) over 16-64 rows, the small-MoE gate_up kernel's shape."""
    top = triton.next_power_of_2(k)
    wide = {GemvConfig(bn, max(128, min(top, elems // bn)), warps)
            for elems, warps in ((8192, 4), (16384, 8)) for bn in (4, 8, 16, 32)
            if -(-n // bn) >= 132 or bn == 4}
    return wide | {GemvConfig(bn, 128, 4) for bn in (16, 32, 64) if -(-n // bn) >= 132}


def bench_moe(sweep: bool) -> list[str]:
    """DeepSeek-V3's routed experts at one token: bf16 vs e4m3 `fused_moe_small` (and the best
    FP8 configs, gate_up and down apart, with `sweep`)."""
    e, h, i, top = MOE_SHAPE
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, h, device="cuda", generator=g).to(torch.bfloat16)
    ids = torch.randperm(e, device="cuda", generator=g)[:top].view(1, top).to(torch.int32)
    wts = torch.rand(1, top, device="cuda", generator=g)
    w13 = (torch.randn(e, 2 * i, h, device="cuda", generator=g) * h**-0.5).to(torch.bfloat16)
    w2 = (torch.randn(e, h, i, device="cuda", generator=g) * i**-0.5).to(torch.bfloat16)
    q13 = [quantize_fp8_blocks(w13[j, :i]) + quantize_fp8_blocks(w13[j, i:]) for j in range(e)]
    q2 = [quantize_fp8_blocks(w2[j]) for j in range(e)]
    w13_q = torch.stack([torch.cat([a, c]) for a, _, c, _ in q13])
    w13_s = torch.stack([torch.cat([b, d]) for _, b, _, d in q13])
    w2_q, w2_s = torch.stack([q for q, _ in q2]), torch.stack([s for _, s in q2])
    bf16_bytes = top * 3 * h * i * 2
    fp8_bytes = top * (3 * h * i + (w13_s[0].numel() + w2_s[0].numel()) * 4)

    def fp8(cfg=None):
        return lambda: fused_moe_small(x, w13_q, w2_q, ids, wts, 0, e, cfg, w13_s, w2_s)

    t_bf16 = _us(lambda: fused_moe_small(x, w13, w2, ids, wts, 0, e))
    t_fp8 = _us(fp8())
    lines = [f"| experts T=1 | bf16 {t_bf16:.2f} µs {bf16_bytes / (t_bf16 * 1e-6) / 1e9:.0f} GB/s"
             f" | e4m3 {t_fp8:.2f} µs {fp8_bytes / (t_fp8 * 1e-6) / 1e9:.0f} GB/s | "
             f"{t_bf16 / t_fp8:.2f}x |"]
    if sweep:
        base = small_moe_config(1, top, h, i, x.device, (128, 128))
        for part in ("gate_up", "down"):
            tried = {}
            for bn in ((8, 16, 32, 64) if part == "gate_up" else (4, 8, 16, 32)):
                for bk, warps in itertools.product((64, 128), (2, 4, 8)):
                    c = base._replace(**{part: GemvConfig(bn, bk, warps)})
                    tried[c] = _us(fp8(c), rep=20)
            c, t = min(tried.items(), key=lambda kv: kv[1])
            lines.append(f"| experts T=1 sweep {part}: best {t:.2f} µs "
                         f"{fp8_bytes / (t * 1e-6) / 1e9:.0f} GB/s at {tuple(getattr(c, part))} "
                         f"(default {tuple(getattr(base, part))}: {tried.get(base, t_fp8):.2f}) |")
    return lines


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    p.add_argument("--sweep", action="store_true", help="also try a few launch configs")
    p.add_argument("--no-gemv", action="store_true", help="skip the M = 1 GEMV table")
    p.add_argument("--gemv-sweep", action="store_true",
                   help="also try launch configs of the W8A16 GEMV and FP8 experts at M = 1")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("fp8_gemm benchmarks CUDA kernels (FP8 GEMMs, the W8A16 GEMV): "
                         "no CUDA device here; run it on a GPU machine")
    peak, bw = bf16_peak_tflops(), copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: bf16 matmul peak {peak:.0f} TFLOP/s (8192^3), copy "
          f"bandwidth {bw / 1e12:.2f} TB/s (read+write); TFLOP/s below")
    print(f"FP8 linear: torch._scaled_mm probe: {scaled_mm_layout(torch.device('cuda'))}")
    print(f"| {'M':>5} | {'K -> N':<14} | {'bf16':>9} | {'fp8 lin':>9} | {'path':<9} | "
          f"{'fp8 gemm':>9} | {'scaled_mm':>9} | {'speedup':>7} | {'% BW':>7} |")
    for m in args.tokens:
        for k, n in SHAPES:
            print(bench_shape(m, k, n, bw, args.sweep), flush=True)
    if not args.no_gemv:
        print(f"\nM = 1, µs and weight GB/s (the copy moved {bw / 1e9:.0f} GB/s, read+write):")
        heads = ["bf16 mm", "bf16 gemv", "fp8 fused", "w8a16 gemv"]
        print(f"| {'K -> N':<14} | " + " | ".join(f"{h:>13}" for h in heads)
              + f" | {'path':<6} | {'vs bf16 gemv':>7} |")
        for k, n in GEMV_SHAPES:
            print(bench_gemv_shape(k, n, args.gemv_sweep), flush=True)
        for line in bench_moe(args.gemv_sweep):
            print(line, flush=True)


if __name__ == "__main__":
    main()
