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
import platform
from datetime import datetime, timezone
from functools import partial

import torch

from moeserve.bench.graph_timing import time_graph

SCHEMA = "moeserve.op_costs/1"
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
