"""`python -m moeserve.bench.moe_kernels`: routed-expert time of the fused-MoE Triton kernels vs
the torch grouped-GEMM path (`MoEExperts.forward_grouped`), on one CUDA GPU.

Shapes: Qwen3-30B-A3B (E=128, H=2048, I=768, K=8) and DeepSeek-V2-Lite (E=64, H=2048, I=1408,
K=6), all experts local, random top-k routing. Times are do_bench medians with L2 flushed (a real
layer's weights are cold). "% BW" is the bytes that must move, the weights of the experts that
received tokens (w13 + w2 of each unique id) plus x in and out, over the time, as a share of the
device-to-device copy bandwidth measured here (a 1 GiB copy counting read + write bytes).

A second table compares the two Triton paths of `fused_moe` at decode batch sizes: the GEMV path
(`small_path=True`, fused_moe_small.py: two launches) and the sorted path (`small_path=False`:
align, two grouped GEMMs, top-k sum), each call captured in a CUDA graph and replayed with L2
flushed, as the decode step runs it. GB/s counts the same bytes as "% BW". Token counts past
SMALL_MAX_PAIRS / K force the GEMV path where `fused_moe` would not take it (the crossover).
"""

from __future__ import annotations

import argparse

import torch

from moeserve.layers.moe import MoEExperts
from moeserve.tools.tune_moe import random_inputs

SHAPES = {  # name: (experts, hidden, intermediate, topk)
    "qwen3-30b-a3b": (128, 2048, 768, 8),
    "deepseek-v2-lite": (64, 2048, 1408, 6),
}
TOKENS = (1, 16, 64, 256, 1024, 4096)
SMALL_TOKENS = (1, 2, 4, 8)


def _bench_us(fn) -> float:
    import triton.testing

    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3


def _graph_us(fn) -> float:
    """_bench_us of one call of fn captured in a CUDA graph (launch gaps as in the decode step)."""
    fn()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return _bench_us(graph.replay)


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Bytes/s of a device-to-device copy, read + write counted."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * nbytes / (_bench_us(lambda: dst.copy_(src)) * 1e-6)


def moved_bytes(ids: torch.Tensor, h: int, i: int, dtype: torch.dtype) -> int:
    """Weights of the touched experts (3*H*I each) plus x [T, H] read and out [T, H] written."""
    size = torch.empty((), dtype=dtype).element_size()
    return (ids.unique().numel() * 3 * h * i + 2 * ids.shape[0] * h) * size


def bench_shape(name: str, tokens: list[int], dtype: torch.dtype, bw: float) -> None:
    from moeserve.kernels.triton.fused_moe import fused_moe

    e, h, i, k = SHAPES[name]
    with torch.device("cuda"):
        experts = MoEExperts(e, h, i)  # weights replaced per token count below
    for t in tokens:
        x, w13, w2, ids, w = random_inputs(t, e, h, i, k, dtype, seed=t)
        experts.w13.data, experts.w2.data = w13, w2
        fused = _bench_us(lambda: fused_moe(x, w13, w2, ids, w))
        ref = _bench_us(lambda: experts.forward_grouped(x, ids, w))
        pct = lambda us: 100 * moved_bytes(ids, h, i, dtype) / (us * 1e-6) / bw  # noqa: E731
        print(f"{name:>17} {t:>6} {fused:>10.1f} {pct(fused):>6.1f}% {ref:>10.1f} "
              f"{pct(ref):>6.1f}% {ref / fused:>7.2f}x", flush=True)
        del x, w13, w2
    del experts
    torch.cuda.empty_cache()


def bench_small(name: str, tokens: list[int], dtype: torch.dtype) -> None:
    """The GEMV path vs the sorted path of fused_moe, each in a CUDA graph."""
    from moeserve.kernels.triton.fused_moe import fused_moe

    e, h, i, k = SHAPES[name]
    for t in tokens:
        x, w13, w2, ids, w = random_inputs(t, e, h, i, k, dtype, seed=t)
        small = _graph_us(lambda: fused_moe(x, w13, w2, ids, w, small_path=True))
        grouped = _graph_us(lambda: fused_moe(x, w13, w2, ids, w, small_path=False))
        gbs = lambda us: moved_bytes(ids, h, i, dtype) / (us * 1e-6) / 1e9  # noqa: E731
        print(f"{name:>17} {t:>6} {small:>10.1f} {gbs(small):>8.0f} {grouped:>10.1f} "
              f"{gbs(grouped):>8.0f} {grouped / small:>7.2f}x", flush=True)
        del x, w13, w2
    torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    p.add_argument("--small-tokens", type=int, nargs="*", default=list(SMALL_TOKENS),
                   help="token counts of the GEMV-vs-sorted table (none: skip it)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("moe_kernels benchmarks CUDA kernels: no CUDA device here")
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e9:.0f} GB/s (read + write)")
    print(f"{'shape':>17} {'tokens':>6} {'triton µs':>10} {'% BW':>7} {'torch µs':>10} "
          f"{'% BW':>7} {'speedup':>8}")
    for name in args.shapes:
        bench_shape(name, args.tokens, getattr(torch, args.dtype), bw)
    if args.small_tokens:
        from moeserve.kernels.triton.fused_moe_small import SMALL_MAX_PAIRS

        print(f"\nfused_moe paths in a CUDA graph, L2 flushed (GEMV: T*K <= {SMALL_MAX_PAIRS} "
              "by default)")
        print(f"{'shape':>17} {'tokens':>6} {'GEMV µs':>10} {'GB/s':>8} {'sorted µs':>10} "
              f"{'GB/s':>8} {'speedup':>8}")
        for name in args.shapes:
            bench_small(name, args.small_tokens, getattr(torch, args.dtype))


if __name__ == "__main__":
    main()
