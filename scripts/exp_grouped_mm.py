"""Experiment (issue 44): Qwen3's expert GEMMs through torch._grouped_mm (CUTLASS grouped GEMM
on sm90) against the fused-MoE Triton kernels, at a 4096-token prefill chunk and a 1344-token
MIXED step, under uniform routing and under the dummy model's collapsed routing (one expert
taking every token, the other seven picks over 27 experts; docs/gpu_decode.md).

The grouped path: sort the pairs by expert, gather the rows, gate/up GEMM, silu * up, down
GEMM, weighted sum of each token's K rows. Each part is timed alone in a CUDA graph (eager where
a part does not capture), and the whole, against `fused_moe` with today's table and with its
weight tiles by TMA. Prints a table; not a test.

    python scripts/exp_grouped_mm.py [--tokens 1344 4096]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton.testing

from moeserve.kernels.triton.fused_moe import fused_moe
from moeserve.kernels.triton.moe_config import get_moe_config
from moeserve.tools.tune_moe import random_inputs

E, H, I, K = 128, 2048, 768, 8


def time_ms(fn) -> tuple[float, str]:
    try:
        return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median"), "graph"
    except Exception:  # noqa: BLE001 - a part that does not capture: eager, L2 not flushed
        torch.cuda.synchronize()
        return triton.testing.do_bench(fn, rep=100, return_mode="median"), "eager"


def collapsed_ids(t: int, seed: int) -> torch.Tensor:
    """Expert 0 for every token, then 7 distinct picks among experts 1..27."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    rest = torch.rand(t, 27, generator=g, device="cuda").argsort(1)[:, : K - 1] + 1
    return torch.cat([torch.zeros(t, 1, dtype=rest.dtype, device="cuda"), rest], 1)


def grouped_parts(x, w13, w2, ids, w):
    """The grouped path's parts as closures over preallocated buffers (graph-capturable)."""
    t = x.shape[0]
    st = {}

    def prep():
        key = ids.flatten()
        st["order"] = key.argsort(stable=True)
        counts = torch.zeros(E, dtype=torch.int32, device=key.device)  # bincount syncs the host
        counts.scatter_add_(0, key, torch.ones_like(key, dtype=torch.int32))
        st["offs"] = counts.cumsum(0).to(torch.int32)
        st["token_of"] = st["order"] // K

    def gather():
        st["xs"] = x.index_select(0, st["token_of"])

    def gemm1():
        st["g"] = torch._grouped_mm(st["xs"], w13.transpose(1, 2), offs=st["offs"])

    def act():
        g = st["g"]
        st["h"] = F.silu(g[:, :I]) * g[:, I:]

    def gemm2():
        st["y"] = torch._grouped_mm(st["h"], w2.transpose(1, 2), offs=st["offs"])

    def combine():
        y = torch.empty_like(st["y"])
        y[st["order"]] = st["y"]
        st["out"] = (y.view(t, K, H).float() * w.float()[..., None]).sum(1).to(x.dtype)

    parts = [("sort", prep), ("gather", gather), ("gate/up GEMM", gemm1), ("silu*up", act),
             ("down GEMM", gemm2), ("combine", combine)]

    def whole():
        for _, fn in parts:
            fn()
        return st["out"]
    return parts, whole, st


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, nargs="+", default=[1344, 4096])
    args = p.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    for t in args.tokens:
        x, w13, w2, ids, w = random_inputs(t, E, H, I, K, torch.bfloat16, seed=t)
        for routing in ("uniform", "collapsed"):
            if routing == "collapsed":
                ids = collapsed_ids(t, t)
            flops1, flops2 = 2.0 * t * K * H * 2 * I, 2.0 * t * K * I * H
            print(f"\n{t} tokens, {routing} routing ({int(torch.unique(ids).numel())} experts)")
            print("| path / part | ms | TFLOP/s |")
            print("|---|---|---|")
            cfg = get_moe_config(E, H, I, K, torch.bfloat16, t)
            ref = fused_moe(x, w13, w2, ids, w, config=cfg, small_path=False)
            tma = dict(cfg, B_TMA=1, num_stages=4)
            if "down" in cfg:
                tma["down"] = dict(cfg["down"], num_stages=4)
            for label, c in (("fused_moe, today's table", cfg), ("fused_moe, B_TMA s4", tma)):
                ms, how = time_ms(lambda c=c: fused_moe(x, w13, w2, ids, w, config=c,
                                                        small_path=False))
                print(f"| {label} ({how}) | {ms:.3f} | {(flops1 + flops2) / ms / 1e9:.0f} |")
            parts, whole, st = grouped_parts(x, w13, w2, ids, w)
            try:
                out = whole()
                torch.cuda.synchronize()
            except Exception as err:  # noqa: BLE001
                print(f"| grouped path | failed: {type(err).__name__}: {err} | |")
                continue
            rel = float((out.double() - ref.double()).norm() / ref.double().norm())
            total = 0.0
            for label, fn in parts:
                ms, how = time_ms(fn)
                total += ms
                fl = {"gate/up GEMM": flops1, "down GEMM": flops2}.get(label)
                rate = f"{fl / ms / 1e9:.0f}" if fl else ""
                print(f"| grouped: {label} ({how}) | {ms:.3f} | {rate} |")
            ms, how = time_ms(whole)
            print(f"| grouped, whole ({how}; parts sum {total:.3f}) | {ms:.3f} | "
                  f"{(flops1 + flops2) / ms / 1e9:.0f} |")
            print(f"grouped vs fused_moe: rel. difference {rel:.1e}")


if __name__ == "__main__":
    main()
