"""`python -m moeserve.bench.attention_kernels`: decode attention µs per layer call, triton vs torch

One call = store the step's K/V + attend (the backend's `forward`, metadata built beforehand), for
one layer of each model's attention shape. %BW is the call's bytes (K/V read once, q and out) over
the device-to-device copy bandwidth measured here (read + write bytes of a large copy). Calls are
timed inside a CUDA graph for graph-safe backends (how decode runs), else eagerly.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from moeserve.attention.base import AttentionSpec
from moeserve.attention.torch_backend import TorchAttentionBackend
from moeserve.attention.triton_backend import TritonAttentionBackend
from moeserve.core import ForwardMode
from moeserve.forward_batch import ForwardBatch
from moeserve.kvcache.pool import MHAKVPool, MLAKVPool
from moeserve.kvcache.table import ReqToTokenPool


@dataclass(frozen=True)
class Shape:
    name: str
    heads: int
    kv_heads: int
    head_dim: int  # key dim: D, or R + r for MLA
    v_head_dim: int
    rope: int = 0  # > 0: absorbed MLA (one latent head)


SHAPES = [
    Shape("Qwen3-30B-A3B", 32, 4, 128, 128),
    Shape("Llama-3-8B", 32, 8, 128, 128),
    Shape("DeepSeek-V2-Lite MLA", 16, 1, 512 + 64, 512, rope=64),
]


def copy_bandwidth(device: torch.device, nbytes: int = 2 << 30) -> float:
    """Bytes/s of a device-to-device copy, counting read + write."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / _time_eager(lambda: dst.copy_(src), iters=20)


def _time_eager(fn, iters: int) -> float:
    """Seconds per call of fn, launched `iters` times between two events."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def _time_call(fn, graph: bool, iters: int = 20, replays: int = 5) -> tuple[float, str]:
    """(seconds per call, 'graph' | 'eager'): with `graph`, `iters` calls captured in one graph
    and replayed (how graph-safe backends run decode), else launched eagerly."""
    fn()
    torch.cuda.synchronize()
    if not graph:
        return _time_eager(fn, iters), "eager"
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(iters):
            fn()
    return _time_eager(g.replay, replays) / iters, "graph"


def _decode_batch(shape: Shape, batch: int, seq_len: int, shuffle: bool, device) -> tuple:
    """A pool holding `batch` requests of seq_len - 1 cached tokens and a decode batch adding one
    token each → (ForwardBatch, q, k, v, spec)."""
    dtype, slots = torch.bfloat16, batch * seq_len
    if shape.rope:
        pool = MLAKVPool(slots, 1, shape.v_head_dim, shape.rope, dtype, device)
        pool.kv[0].normal_()
    else:
        pool = MHAKVPool(slots, 1, shape.kv_heads, shape.head_dim, shape.v_head_dim, dtype,
                         device)
        pool.k[0].normal_()
        pool.v[0].normal_()
    table = ReqToTokenPool(batch, seq_len, device)
    order = torch.randperm(slots) if shuffle else torch.arange(slots)
    table.req_to_token.copy_((order + 1).view(batch, seq_len).to(device))
    rows = torch.arange(batch, device=device)
    fb = ForwardBatch(
        forward_mode=ForwardMode.DECODE, input_ids=torch.zeros(batch, dtype=torch.int64,
                                                               device=device),
        positions=torch.full((batch,), seq_len - 1, device=device),
        out_cache_loc=table.req_to_token[:, seq_len - 1].clone(), req_pool_indices=rows,
        seq_lens=torch.full((batch,), seq_len, device=device), seq_lens_cpu=[seq_len] * batch,
        extend_prefix_lens_cpu=[seq_len - 1] * batch, extend_seq_lens_cpu=[1] * batch,
        req_to_token_pool=table, kv_pool=pool, attn_backend=None)
    q = torch.randn(batch, shape.heads, shape.head_dim, dtype=dtype, device=device)
    k = torch.randn(batch, shape.kv_heads, shape.head_dim, dtype=dtype, device=device)
    v = None if shape.rope else torch.randn(batch, shape.kv_heads, shape.v_head_dim,
                                            dtype=dtype, device=device)
    spec = AttentionSpec(0, shape.heads, shape.kv_heads, shape.head_dim, shape.v_head_dim,
                         shape.head_dim**-0.5)
    return fb, q, k, v, spec


def call_bytes(shape: Shape, batch: int, seq_len: int, elt: int = 2) -> int:
    """K/V read once per request (MLA: the one latent) plus q read and out written."""
    kv = shape.head_dim if shape.rope else shape.kv_heads * (shape.head_dim + shape.v_head_dim)
    return batch * elt * (seq_len * kv + shape.heads * (shape.head_dim + shape.v_head_dim))


def bench_row(shape: Shape, batch: int, seq_len: int, splits: int, shuffle: bool, device):
    fb, q, k, v, spec = _decode_batch(shape, batch, seq_len, shuffle, device)
    times = {}
    for name, backend in (("triton", TritonAttentionBackend(splits)),
                          ("torch", TorchAttentionBackend())):
        fb.attn_backend = backend
        backend.init_forward_metadata(fb)
        times[name] = _time_call(lambda b=backend: b.forward(q, k, v, spec, fb),
                                 graph=backend.graph_safe)
    del fb
    torch.cuda.empty_cache()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[512, 4096])
    parser.add_argument("--num-kv-splits", type=int, default=None, help="default: by batch size")
    parser.add_argument("--shuffle-slots", action="store_true",
                        help="scatter each request's KV slots (default: contiguous)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    device = torch.device("cuda")
    bw = copy_bandwidth(device)
    print(f"{torch.cuda.get_device_name(device)}: copy bandwidth {bw / 1e9:.0f} GB/s "
          f"(read + write); bf16, num_kv_splits={args.num_kv_splits}")
    head = (f"{'shape':<22}{'batch':>6}{'seq':>6}{'triton µs':>11}{'%BW':>6}"
            f"{'torch µs':>11}{'%BW':>6}{'speedup':>9}  timing")
    print(head + "\n" + "-" * len(head))
    for shape in SHAPES:
        for batch in args.batches:
            for seq_len in args.seq_lens:
                t = bench_row(shape, batch, seq_len, args.num_kv_splits, args.shuffle_slots,
                              device)
                nbytes = call_bytes(shape, batch, seq_len)
                (tt, tmode), (rt, rmode) = t["triton"], t["torch"]
                print(f"{shape.name:<22}{batch:>6}{seq_len:>6}{tt * 1e6:>11.1f}"
                      f"{100 * nbytes / tt / bw:>6.0f}{rt * 1e6:>11.1f}"
                      f"{100 * nbytes / rt / bw:>6.0f}{rt / tt:>8.1f}x  {tmode}/{rmode}")


if __name__ == "__main__":
    main()
