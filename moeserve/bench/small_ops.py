"""`python -m moeserve.bench.small_ops`: µs per call of the small per-layer ops, Triton
(`kernels.triton.ops`, and the sampler's argmax, kernels/triton/argmax.py) vs the torch path they
replace, at Qwen3-30B-A3B shapes (CUDA only).

Two timings per row: eager (a loop of calls: host launch cost included, as without CUDA graphs) and
graph (the same calls captured once in a CUDA graph and replayed: device time plus the gaps between
kernels, as the decode step runs).

A second table times the linears at decode row counts M: the small-M GEMV (kernels/triton/gemv.py;
`Linear` takes it at M <= LINEAR_MAX_M) vs F.linear (cuBLAS), with GB/s of the graph timings
(weight + x + out bytes). Successive calls cycle through copies of the weight totalling at least
COLD_BYTES, so the weights come from HBM, not L2, as in a model's step.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from moeserve.kernels.triton.argmax import argmax_rows
from moeserve.kernels.triton.gemv import gemv
from moeserve.kernels.triton.ops import TritonOps
from moeserve.layers.norm import RMSNorm, rms_norm_heads
from moeserve.layers.rotary import RotaryEmbedding
from moeserve.layers.router import RouterConfig, select_experts

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, EXPERTS, TOP_K, EPS = 2048, 32, 4, 128, 128, 8, 1e-6
VOCAB = 151936
# Qwen3-30B-A3B's linears, (in, out): qkv_proj, o_proj, the router, the LM head
LINEARS = {"qkv 2048->5120": (2048, 5120), "o_proj 4096->2048": (4096, 2048),
           "router 2048->128": (2048, 128), "lm_head 2048->151936": (2048, 151936)}
COLD_BYTES = 512 << 20  # weight copies cycled per row: several times the H200's 60 MB L2


def time_us(fn: Callable[[], object], iters: int, graph: bool) -> float:
    """Mean µs per call of `fn`, eagerly or replayed from one CUDA graph of `iters` calls."""
    for _ in range(3):  # warm-up: Triton compiles, the allocator settles
        fn()
    torch.cuda.synchronize()
    if graph:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=stream):
            for _ in range(iters):
                fn()
        run = g.replay
    else:
        def run():
            for _ in range(iters):
                fn()
    run()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (5 * iters)


def cases(t: int, dtype: torch.dtype, ops: TritonOps) -> dict[str, tuple[Callable, Callable]]:
    """name → (torch path, Triton) closures over fresh inputs of t tokens."""
    norm = RMSNorm(HIDDEN, EPS).to(dtype)
    q_norm, k_norm = RMSNorm(HEAD_DIM, EPS).to(dtype), RMSNorm(HEAD_DIM, EPS).to(dtype)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))
    rope = RotaryEmbedding(inv_freq, 1.0, 4096)
    x, res = torch.randn(t, HIDDEN, dtype=dtype), torch.randn(t, HIDDEN, dtype=dtype)
    qkv = torch.randn(t, (HEADS + 2 * KV_HEADS) * HEAD_DIM, dtype=dtype)
    pos = torch.randint(0, 4096, (t,))
    logits = torch.randn(t, EXPERTS, dtype=dtype)
    router = RouterConfig(top_k=TOP_K, renormalize=True)
    vocab = torch.randn(t, VOCAB, dtype=dtype)  # logits for the sampler's greedy pick
    n = HEADS + KV_HEADS

    def torch_qk():
        qk = qkv[:, : n * HEAD_DIM].view(t, n, HEAD_DIM)
        return rope.rotate(pos, rms_norm_heads(qk, [(HEADS, q_norm), (KV_HEADS, k_norm)]))

    return {
        "rms_norm": (lambda: norm(x), lambda: ops.rms_norm(x, norm.weight, EPS)),
        "rms_norm + residual": (lambda: norm(x, res),
                                lambda: ops.rms_norm(x, norm.weight, EPS, res)),
        "qk_norm_rope": (torch_qk, lambda: ops.qk_norm_rope(
            qkv, HEADS, KV_HEADS, HEAD_DIM, pos, rope.cos_sin_cache, HEAD_DIM, q_norm.weight,
            k_norm.weight, EPS)),
        "topk_softmax": (lambda: select_experts(logits, router),
                         lambda: ops.topk_softmax(logits, TOP_K, True)),
        "greedy argmax": (lambda: vocab.argmax(-1), lambda: argmax_rows(vocab)),
    }


def linear_cases(m: int, dtype: torch.dtype) -> dict[str, tuple[Callable, Callable, int]]:
    """name → (F.linear, gemv, bytes per call) closures at M = m rows; each call takes the next
    weight copy (of enough copies to leave L2 cold)."""
    out = {}
    for name, (k, n) in LINEARS.items():
        size = n * k * dtype.itemsize
        ws = [torch.randn(n, k, dtype=dtype) * k**-0.5 for _ in range(max(1, COLD_BYTES // size))]
        x = torch.randn(m, k, dtype=dtype)
        ref_ws, our_ws = itertools.cycle(ws), itertools.cycle(ws)
        out[name] = (lambda x=x, it=ref_ws: F.linear(x, next(it)),
                     lambda x=x, it=our_ws: gemv(x, next(it)),
                     size + (m * k + m * n) * dtype.itemsize)
    return out


def bench_linears(rows: list[int], dtype: torch.dtype, iters: int) -> None:
    cols = ["torch eager", "gemv eager", "torch graph", "gemv graph"]
    print(f"\n{'linear':<22}{'M':>6}" + "".join(f"{c:>14}" for c in cols)
          + f"{'graph x':>9}{'torch GB/s':>12}{'gemv GB/s':>11}")
    for m in rows:
        for name, (ref, ours, nbytes) in linear_cases(m, dtype).items():
            us = [time_us(fn, iters, graph) for graph in (False, True) for fn in (ref, ours)]
            row = "".join(f"{u:>14.2f}" for u in us)
            gbs = [nbytes / (u * 1e-6) / 1e9 for u in us[2:]]
            print(f"{name:<22}{m:>6}{row}{us[2] / us[3]:>8.2f}x{gbs[0]:>12.0f}{gbs[1]:>11.0f}",
                  flush=True)
        torch.cuda.empty_cache()


def fusion_cases(b: int, seq: int, dtype: torch.dtype,
                 ops: TritonOps) -> dict[str, tuple[Callable, Callable]]:
    """name → (two launches, one launch) closures of the decode fusions at batch b, Qwen3-30B-A3B
    shapes: the KV store in q/k norm + rope, the split-KV reduction by the last split, and the
    router GEMV with its top-k (one row; weight copies cycled so they come from HBM)."""
    from moeserve.kernels.triton.router_topk import router_topk
    from moeserve.kernels.triton.attention import KVStoreTarget, decode_attention, store_kv

    q_norm, k_norm = RMSNorm(HEAD_DIM, EPS).to(dtype), RMSNorm(HEAD_DIM, EPS).to(dtype)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))
    rope = RotaryEmbedding(inv_freq, 1.0, 4096)
    qkv = torch.randn(b, (HEADS + 2 * KV_HEADS) * HEAD_DIM, dtype=dtype)
    pos = torch.randint(0, 4096, (b,))
    slots = b * seq
    k_buf = torch.randn(slots + 1, KV_HEADS, HEAD_DIM, dtype=dtype)
    v_buf = torch.randn(slots + 1, KV_HEADS, HEAD_DIM, dtype=dtype)
    loc = torch.arange(1, b + 1)
    table = torch.arange(1, slots + 1).view(b, seq)
    rows, seq_lens = torch.arange(b), torch.full((b,), seq)
    q = torch.randn(b, HEADS, HEAD_DIM, dtype=dtype)
    out = torch.empty(b, HEADS, HEAD_DIM, dtype=dtype)
    splits = min(32, max(4, 1 << (-(-256 // (b * KV_HEADS)) - 1).bit_length()))  # as the backend
    part_out = torch.empty(b, HEADS, splits, HEAD_DIM, dtype=torch.float32)
    part_lse = torch.empty(b, HEADS, splits, dtype=torch.float32)
    qkv_rows = qkv.view(b, -1, HEAD_DIM)
    rope_args = (qkv, HEADS, KV_HEADS, HEAD_DIM, pos, rope.cos_sin_cache, HEAD_DIM,
                 q_norm.weight, k_norm.weight, EPS)

    def rope_then_store():
        ops.qk_norm_rope(*rope_args)
        store_kv(qkv_rows[:, HEADS: HEADS + KV_HEADS], qkv_rows[:, HEADS + KV_HEADS:], loc,
                 k_buf, v_buf)

    def attention(fuse: bool):
        return lambda: decode_attention(q, k_buf, v_buf, table, rows, seq_lens, HEAD_DIM**-0.5,
                                        HEAD_DIM, HEAD_DIM, out, part_out, part_lse,
                                        fuse_reduce=fuse)

    x = torch.randn(1, HIDDEN, dtype=dtype)
    ws = [torch.randn(EXPERTS, HIDDEN, dtype=dtype) * HIDDEN**-0.5 for _ in range(512)]
    two_ws, one_ws = itertools.cycle(ws), itertools.cycle(ws)
    return {
        "qk rope | kv store": (rope_then_store, lambda: ops.qk_norm_rope(
            *rope_args, store=KVStoreTarget(k_buf, v_buf, loc))),
        f"decode attn s={seq}": (attention(False), attention(True)),
        "router gemv | top-k": (lambda: ops.topk_softmax(gemv(x, next(two_ws)), TOP_K, True),
                                lambda: router_topk(x, next(one_ws), TOP_K, True)),
    }


def bench_fusions(batches: list[int], seq: int, dtype: torch.dtype, ops: TritonOps,
                  iters: int) -> None:
    cols = ["2 launches eager", "1 launch eager", "2 launches graph", "1 launch graph"]
    print(f"\n{'fusion':<22}{'B':>6}" + "".join(f"{c:>18}" for c in cols) + f"{'graph x':>9}")
    for b in batches:
        for name, (two, one) in fusion_cases(b, seq, dtype, ops).items():
            if name.startswith("router") and b != 1:
                continue  # the one-launch router takes one token
            us = [time_us(fn, iters, graph) for graph in (False, True) for fn in (two, one)]
            row = "".join(f"{u:>18.2f}" for u in us)
            print(f"{name:<22}{b:>6}{row}{us[2] / us[3]:>8.2f}x", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--linear-rows", type=int, nargs="*", default=[1, 4, 8],
                    help="M of the linear table (none: skip it)")
    ap.add_argument("--iters", type=int, default=100, help="calls per timing (and per graph)")
    ap.add_argument("--fusion-batches", type=int, nargs="*", default=[1, 64],
                    help="batch sizes of the decode-fusion table (none: skip it)")
    ap.add_argument("--fusion-seq", type=int, default=512, help="context of its attention rows")
    ap.add_argument("--only-fusions", action="store_true", help="print only that table")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("small_ops benchmarks CUDA kernels: no CUDA device")
    torch.set_default_device("cuda")
    dtype, ops = getattr(torch, args.dtype), TritonOps()
    cols = ["torch eager", "triton eager", "torch graph", "triton graph"]
    print(f"{'op':<22}{'T':>6}" + "".join(f"{c:>14}" for c in cols) + f"{'graph x':>9}")
    with torch.inference_mode():
        if args.fusion_batches:
            bench_fusions(args.fusion_batches, args.fusion_seq, dtype, ops, args.iters)
        if args.only_fusions:
            return
        for t in args.tokens:
            for name, (ref, ours) in cases(t, dtype, ops).items():
                us = [time_us(fn, args.iters, graph) for graph in (False, True)
                      for fn in (ref, ours)]
                row = "".join(f"{u:>14.2f}" for u in us)
                print(f"{name:<22}{t:>6}{row}{us[2] / us[3]:>8.1f}x", flush=True)
        if args.linear_rows:
            bench_linears(args.linear_rows, dtype, args.iters)


if __name__ == "__main__":
    main()
