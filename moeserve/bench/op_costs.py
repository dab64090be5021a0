"""`python -m moeserve.bench.op_costs --out FILE.json`: the kernel-cost table the planner reads.

Measures, on one GPU, what one decode or prefill step is made of, with the kernels the runtime
dispatches to (and, where another stack would run something else, that too under its own `impl`):
GEMMs (bf16 and block-FP8, by tokens M, on the linear shapes of DeepSeek-V3, Qwen3-30B-A3B and
Llama-3-8B), MLA's per-head absorption products, the fused MoE (bf16 / FP8, by tokens, which the
planner turns into time per expert by tokens per expert), decode attention (GQA and MLA by batch
and context), extend attention (one causal prompt by length: ours, and torch's SDPA as the
MHA-style prefill other stacks run), RMSNorm and routers, plus the device's copy bandwidth and
matmul peaks. Every op is timed as a CUDA graph of back-to-back calls over weight copies larger
than L2 (a decode step's weights are cold), so the gaps between launches are in the figures.

The JSON is versioned (`schema`) and committed under `moeserve/planner/costs/` per GPU; the
planner interpolates between its points (moeserve/planner/costs.py). `--device cpu --smoke`
runs tiny shapes with torch ops: a check that the writer works, not a table to plan with.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time
from collections.abc import Callable
from datetime import datetime, timezone
from functools import partial

import torch

SCHEMA = "moeserve.op_costs/1"
COLD_BYTES = 256 << 20  # weights cycled per graph: several times an H100/H200 L2 (50-60 MB)
TARGET_S = 4e-3  # device time of one timed graph replay


def time_graph(make_call: Callable[[int], Callable[[], object]], copies: int,
               device: torch.device) -> float:
    """Microseconds per call: `reps` calls captured in one CUDA graph, call i on copy i %
    copies, replayed; median of 3 replays. `make_call(i)` returns the i-th call. On CPU (or
    where capture fails) eager calls timed with perf_counter."""
    calls = [make_call(i) for i in range(copies)]
    for c in calls:
        c()  # compile / probe outside any capture
    if device.type != "cuda":
        return _time_eager_cpu(calls)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    calls[0]()
    torch.cuda.synchronize()
    one = max(time.perf_counter() - t0, 1e-6)
    reps = int(min(max(TARGET_S / one, 2 * copies), 200))
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for r in range(reps):
                calls[r % copies]()
    except RuntimeError:
        torch.cuda.synchronize()
        return _time_eager_cuda(calls, reps)
    return _replay_us(graph.replay, reps)


def _replay_us(fn: Callable[[], object], reps: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    out = []
    for _ in range(3):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        out.append(start.elapsed_time(end) * 1e3 / reps)
    return statistics.median(out)


def _time_eager_cuda(calls: list[Callable[[], object]], reps: int) -> float:
    def run() -> None:
        for r in range(reps):
            calls[r % len(calls)]()
    return _replay_us(run, reps)


def _time_eager_cpu(calls: list[Callable[[], object]]) -> float:
    out = []
    for _ in range(3):
        t0 = time.perf_counter()
        for c in calls:
            c()
        out.append((time.perf_counter() - t0) / len(calls) * 1e6)
    return statistics.median(out)


def copies_for(nbytes: int) -> int:
    """Weight copies so that one pass over them exceeds L2 several times (at most 8)."""
    return int(min(8, max(1, math.ceil(COLD_BYTES / max(nbytes, 1)))))


def device_peaks(device: torch.device) -> dict[str, float]:
    """Copy bandwidth (read + write GB/s) and bf16 / FP8 matmul TFLOP/s at 8192^3."""
    if device.type != "cuda":
        return {"copy_gbps": 0.0, "bf16_tflops": 0.0, "fp8_tflops": 0.0}
    n = 1 << 29
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    us = time_graph(lambda i, f=partial(dst.copy_, src): f, 1, device)
    peaks = {"copy_gbps": 2 * n / us / 1e3}
    del src, dst
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    us = time_graph(lambda i: (lambda: a @ a), 1, device)
    peaks["bf16_tflops"] = 2 * 8192**3 / us / 1e6
    try:
        a8 = a.to(torch.float8_e4m3fn)
        one = torch.ones((), device=device)
        us = time_graph(lambda i: (lambda: torch._scaled_mm(
            a8, a8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)), 1, device)
        peaks["fp8_tflops"] = 2 * 8192**3 / us / 1e6
    except (RuntimeError, TypeError):
        peaks["fp8_tflops"] = 0.0
    torch.cuda.empty_cache()
    return peaks


def smoke_ops(device: torch.device) -> dict[str, list[dict]]:
    """Tiny torch-only cases (CPU): the table's format, not a table to plan with."""
    import torch.nn.functional as F

    ops: dict[str, list[dict]] = {"gemm": [], "moe": [], "norm": []}
    ms = [1, 4, 16]
    for k, n in [(64, 128), (128, 64)]:
        w = torch.randn(n, k, device=device)
        us = [time_graph(lambda i, x=torch.randn(m, k, device=device): (lambda: F.linear(x, w)),
                         1, device) for m in ms]
        ops["gemm"].append(dict(impl="torch", dtype="fp32", k=k, n=n, m=ms, us=us))
    e, h, inter, topk = 8, 64, 32, 2
    w13 = torch.randn(e, 2 * inter, h, device=device)
    w2 = torch.randn(e, h, inter, device=device)
    us, touched = [], []
    for t in ms:
        x = torch.randn(t, h, device=device)
        ids = torch.randint(0, e, (t, topk), device=device)
        touched.append(int(ids.unique().numel()))

        def moe(x=x, ids=ids) -> torch.Tensor:
            out = torch.zeros_like(x)
            for j in range(topk):
                up = torch.einsum("th,tih->ti", x, w13[ids[:, j]])
                g, u = up.chunk(2, dim=-1)
                out += torch.einsum("ti,thi->th", F.silu(g) * u, w2[ids[:, j]])
            return out
        us.append(time_graph(lambda i, f=moe: f, 1, device))
    ops["moe"].append(dict(impl="torch", dtype="fp32", experts=e, h=h, i=inter, topk=topk,
                           tokens=ms, touched=touched, us=us))
    wn = torch.ones(h, device=device)
    us = [time_graph(lambda i, x=torch.randn(m, h, device=device):
                     (lambda: F.rms_norm(x, (h,), wn)), 1, device) for m in ms]
    ops["norm"].append(dict(impl="torch", h=h, tokens=ms, us=us))
    return ops


def write_table(path: str, device: torch.device, ops: dict[str, list[dict]],
                peaks: dict[str, float], note: str) -> dict:
    """The versioned JSON: schema, device, software, peaks, ops."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    table = {
        "schema": SCHEMA, "device": name or "cpu",
        "created": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "torch": torch.__version__, "triton": _triton_version(), "note": note,
        "peaks": peaks, "ops": ops,
    }
    with open(path, "w") as f:
        json.dump(table, f, indent=1)
        f.write("\n")
    return table


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--smoke", action="store_true", help="tiny torch-only shapes (CPU check)")
    p.add_argument("--only", nargs="*", default=None,
                   help="op families to measure (gemm moe attn_decode attn_extend norm router)")
    p.add_argument("--note", default="", help="free text kept in the table")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(0)
    if args.smoke or device.type != "cuda":
        ops, peaks = smoke_ops(device), device_peaks(device)
    else:
        from moeserve.bench.op_cost_cases import measure_all

        peaks = device_peaks(device)
        print(f"{torch.cuda.get_device_name(device)}: {peaks}", flush=True)
        ops = measure_all(device, args.only,
                          lambda done: write_table(args.out, device, done, peaks, args.note))
    table = write_table(args.out, device, ops, peaks, args.note)
    n = sum(len(row.get("us", [])) for rows in table["ops"].values() for row in rows)
    print(f"wrote {args.out}: {n} points on {table['device']}")


if __name__ == "__main__":
    main()
