"""`python -m moeserve.bench.fp8_dot_precision`: how far the FP8 kernels stand from their float64
emulation (layers/fp8_emulation.py), path by path, with the FP8 tiles multiplied as served (on
sm90 FP8 wgmma, whose accumulator is not float32 within a dot) and widened to bf16 first
(`kernels/triton/fp8.py` EXACT_DOT), and what each costs at M = 4096. docs/fp8.md has an H100 run.

Rows: the Triton block GEMM, the fused quantize + GEMM and torch._scaled_mm (where the probe
accepts it) against the emulation rounded to bf16, the sorted fused MoE, and the GEMM / MoE speed.
"""

from __future__ import annotations

import argparse

import torch

from moeserve.kernels.fp8_format import quantize_fp8_blocks
from moeserve.kernels.triton import fp8 as kernels
from moeserve.layers.fp8_emulation import emulate_fp8_matmul, emulate_fp8_moe
from moeserve.layers.fp8_linear import scaled_mm_layout, scaled_mm_linear
from moeserve.layers.fp8_moe import Fp8MoEExperts

BLOCK = (128, 128)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _experts(dev: torch.device, g: torch.Generator) -> Fp8MoEExperts:
    """12 experts of 2048 x 768 (Qwen3-30B-A3B's shape), all local."""
    mod = Fp8MoEExperts(12, 2048, 768, first_expert=0, num_local=12, backend="triton")
    for e in range(12):
        q, s = quantize_fp8_blocks(torch.randn(1536, 2048, generator=g) * 0.05)
        mod.w13.data[e], mod.w13_scale_inv.data[e] = q, s  # [gate | up], 768 = 6 blocks each
        q, s = quantize_fp8_blocks(torch.randn(2048, 768, generator=g) * 0.05)
        mod.w2.data[e], mod.w2_scale_inv.data[e] = q, s
    return mod.to(dev)


def accuracy(mode: str, dev: torch.device, ms: list[int]) -> None:
    g = torch.Generator().manual_seed(0)
    layout = scaled_mm_layout(dev)
    for n, k in [(200, 320), (640, 1536), (2048, 7168), (7168, 2048)]:
        q, s = quantize_fp8_blocks(torch.randn(n, k, generator=g) * 0.05)
        q, s = q.to(dev), s.to(dev)
        for m in ms:
            x = (torch.randn(m, k, generator=g) * 2).to(dev, torch.bfloat16)
            emu = emulate_fp8_matmul(x, q, s, BLOCK, True).to(torch.bfloat16)
            x_q, x_s = kernels.quant_fp8_per_token_group(x, BLOCK[1])
            gemm = kernels.fp8_block_matmul(x_q, x_s, q, s, torch.bfloat16, BLOCK)
            fused = kernels.fp8_quant_matmul(x, q, s, BLOCK)
            row = (f"| {mode} | {k} -> {n} | {m} | {_rel(gemm, emu):.2e} | "
                   f"{_rel(fused, emu):.2e} | ")
            ok = layout is not None and k % 512 == 0 and n % 16 == 0
            row += f"{_rel(scaled_mm_linear(x, q, s, layout), emu):.2e} |" if ok else "- |"
            print(row, flush=True)
    mod = _experts(dev, g)
    for t in (100, 2048):
        x = torch.randn(t, 2048, generator=g).to(dev, torch.bfloat16)
        ids = torch.stack([torch.randperm(12, generator=g)[:4] for _ in range(t)]).to(dev)
        w = torch.rand(t, 4, generator=g)
        w = (w / w.sum(1, keepdim=True)).to(dev)
        err = _rel(mod(x, ids, w), emulate_fp8_moe(mod, x, ids, w))
        print(f"| {mode} | sorted MoE, T = {t} | - | {err:.2e} | - | - |", flush=True)


def speed(mode: str, dev: torch.device) -> None:
    from triton.testing import do_bench

    g = torch.Generator().manual_seed(1)
    mod = _experts(dev, g)
    x = torch.randn(4096, 2048, generator=g).to(dev, torch.bfloat16)
    ids = torch.stack([torch.randperm(12, generator=g)[:4] for _ in range(4096)]).to(dev)
    w = torch.full((4096, 4), 0.25, device=dev)
    t = do_bench(lambda: mod(x, ids, w), return_mode="median")
    flops = 2 * 4096 * 4 * 3 * 2048 * 768
    print(f"| {mode} | MoE T = 4096 (12 x 2048 x 768, top-4) | {t * 1e3:.1f} | "
          f"{flops / t / 1e9:.0f} |", flush=True)
    for n, k in [(18432, 7168), (7168, 16384), (4096, 7168)]:
        q, s = quantize_fp8_blocks(torch.randn(n, k, generator=g) * 0.05)
        q, s = q.to(dev), s.to(dev)
        x_q, x_s = kernels.quant_fp8_per_token_group(
            torch.randn(4096, k, device=dev, dtype=torch.bfloat16), BLOCK[1])
        t = do_bench(lambda a=x_q, a_s=x_s, b=q, b_s=s: kernels.fp8_block_matmul(
            a, a_s, b, b_s, torch.bfloat16, BLOCK), return_mode="median")
        print(f"| {mode} | GEMM M = 4096, {k} -> {n} | {t * 1e3:.1f} | "
              f"{2 * 4096 * n * k / t / 1e9:.0f} |", flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--m", type=int, nargs="+", default=[5, 16, 40, 300, 2048])
    p.add_argument("--no-speed", action="store_true")
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    print("| dot | shape | M | block GEMM vs emulation | fused | torch._scaled_mm |")
    print("|---|---|---|---|---|---|")
    for exact in (False, True):
        kernels.EXACT_DOT = exact
        accuracy("exact (bf16)" if exact else "served (fp8)", dev, args.m)
    if not args.no_speed:
        print("| dot | op | us | TFLOP/s |\n|---|---|---|---|")
        for exact in (False, True):
            kernels.EXACT_DOT = exact
            speed("exact (bf16)" if exact else "served (fp8)", dev)
    kernels.EXACT_DOT = False


if __name__ == "__main__":
    main()
