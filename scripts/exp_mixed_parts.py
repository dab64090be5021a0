"""Experiment (issue 44): where the MIXED step's fused MoE (Qwen3's experts, 1344 tokens, uniform
random routing) spends its time, part by part against each part's byte floor: align, the gate/up
GEMM (w13's touched bytes), the down GEMM (w2's) with a few down tiles, and the top-k sum (its
[T*K, H] reads and [T, H] writes). Each part alone in a CUDA graph; the copy bandwidth is measured
by the same run. Prints a table; not a test.

    python scripts/exp_mixed_parts.py [--tokens 1344]
"""

from __future__ import annotations

import argparse

import torch
from triton.testing import do_bench_cudagraph

from moeserve.bench.roofline import measure_copy_bandwidth
from moeserve.kernels.triton import fused_moe as fm
from moeserve.kernels.triton.moe_align import moe_align_block_size
from moeserve.kernels.triton.moe_config import down_config, get_moe_config
from moeserve.tools.tune_moe import random_inputs

E, H, I, K = 128, 2048, 768, 8
# down tiles (BLOCK_SIZE_N, BLOCK_SIZE_K, num_stages, B_TMA, num_warps)
DOWN_TILES = [(128, 64, 4, 1, 8), (256, 64, 4, 1, 8), (256, 64, 3, 0, 8), (128, 64, 3, 0, 8),
              (64, 64, 4, 1, 8)]
SWEEP = [(bn, bk, st, tma, w) for bn in (128, 256) for bk in (64, 128) for st in (2, 3, 4, 5)
         for tma in (0, 1) for w in (8,)] + [(128, 128, 3, 1, 4), (64, 128, 4, 1, 4)]


def us(fn) -> float:
    fn()
    return do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=1344)
    p.add_argument("--down-sweep", action="store_true", help="more down tiles (SWEEP), and the "
                   "whole call with the fastest")
    args = p.parse_args()
    t = args.tokens
    bw = measure_copy_bandwidth(torch.device("cuda"))  # bytes/s, read + write
    x, w13, w2, ids, tw = random_inputs(t, E, H, I, K, torch.bfloat16, seed=t)
    cfg = get_moe_config(E, H, I, K, torch.bfloat16, t)
    touched = int(torch.unique(ids).numel())
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e12:.2f} TB/s; {t} tokens, {touched} "
          f"experts touched; config {cfg}")
    sid, eid, npost = moe_align_block_size(ids, cfg["BLOCK_SIZE_M"], 0, E, False)
    inter = x.new_empty((t * K, I))
    y = x.new_empty((t * K, H))
    out = x.new_empty((t, H))
    w = tw.float().contiguous().view(-1)
    b13, b2 = touched * 2 * I * H * 2, touched * H * I * 2
    rows = [("align", lambda: moe_align_block_size(ids, cfg["BLOCK_SIZE_M"], 0, E, False), 0),
            ("gate/up GEMM", lambda: fm._grouped_gemm(x, w13, inter, None, sid, eid, npost, K,
                                                      True, cfg), b13)]
    downs = [("down GEMM, today", down_config(cfg))]
    for bn, bk, stages, tma, warps in SWEEP if args.down_sweep else DOWN_TILES:
        downs.append((f"down GEMM, {bn}x{bk} w{warps} s{stages}{' tma' if tma else ''}",
                      dict(down_config(cfg), BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk, num_warps=warps,
                           num_stages=stages, B_TMA=tma)))
    for label, dc in downs:
        rows.append((label, lambda dc=dc: fm._grouped_gemm(inter, w2, y, w, sid, eid, npost, 1,
                                                           False, dc), b2))
    rows.append(("top-k sum", lambda: fm.sum_local_pairs(y, ids, out, 0, E),
                 t * K * H * 2 + t * H * 2))
    rows.append(("whole fused_moe", lambda: fm.fused_moe(x, w13, w2, ids, tw, config=cfg,
                                                         small_path=False), b13 + b2))
    print("| part | us | bytes floor us | % of floor |")
    print("|---|---|---|---|")
    best = (float("inf"), None)
    for label, fn, nbytes in rows:
        try:
            got = us(fn)
        except Exception as err:  # noqa: BLE001 - a tile that does not fit: say so, go on
            print(f"| {label} | skipped: {type(err).__name__} | | |")
            continue
        if label.startswith("down"):
            best = min(best, (got, label), key=lambda b: b[0])
        floor = nbytes / bw * 1e6 if nbytes else 0.0  # bytes moved at the copy's read + write rate
        share = f"{100 * floor / got:.1f}%" if nbytes else ""
        print(f"| {label} | {got:.1f} | {floor:.1f} | {share} |", flush=True)
    if args.down_sweep and best[1] is not None:
        dc = dict(downs)[best[1]]
        whole = dict(cfg, down={k: v for k, v in dc.items() if k != "BLOCK_SIZE_M"})
        got = us(lambda: fm.fused_moe(x, w13, w2, ids, tw, config=whole, small_path=False))
        print(f"whole fused_moe with the fastest down tile ({best[1]}): {got:.1f} us "
              f"({100 * (b13 + b2) / bw * 1e6 / got:.1f}% of the floor)")


if __name__ == "__main__":
    main()
