"""`python -m moeserve.bench.ep`: dispatch + combine time and bandwidth of each EP backend.

Spawns --world ranks (CUDA: one per GPU over NCCL; otherwise CPU processes over gloo). Each rank
routes its tokens/rank tokens to uniform random top-k experts, then times dispatch → combine (the
experts are skipped: combine gets the received hidden states back unchanged) and, for reference, a
raw all_to_all_single pair that moves exactly the same hidden-state rows (no count exchange, no
gather/scatter). Warmup, then --iters calls back to back between CUDA events (perf_counter on
CPU), median over 5 such runs; the reported time is the slowest rank's (see time_ms).

Bandwidth: what crosses NVLink, one direction. For this rank let S = (token, destination rank)
pairs of its tokens (each token goes once to every rank owning one of its experts, DeepEP
normal-mode routing), R = rows it receives, and L = its tokens routed to itself (in S and in R,
never on a link). Dispatch sends S - L rows to other GPUs and combine sends R - L, so the bytes
the rank puts on its links are B = (S + R - 2L) × hidden × element size (ids, weights and counts
not counted; links carry as much inbound). GB/s/GPU = B / time, averaged over ranks, and "% peak"
compares it with the NVLink peak per direction. Every backend is charged the same B (useful bytes),
so a backend that sends more (allgather sends every token to every rank) pays for it in time.

DeepEP (built from source: scripts/build_deepep.sh): `--backend deepep-normal deepep-low_latency`
add its two modes through our adapter (`deepep` alone: mode auto, which --mode picks). One Buffer
per mode serves every size. Low-latency sends each (token, expert) pair and sizes its buffers by
the most tokens per rank, so its rows stop at --ll-max-tokens (the decode batches it is for).
`--deep-ep-module fake_deep_ep` runs the adapter on the in-repo emulation (tests, CPU).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import socket
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moeserve.bench.profiling import profile_table
from moeserve.core import ForwardMode
from moeserve.distributed import ParallelMesh
from moeserve.ep.comm import exchange_counts
from moeserve.ep.dispatcher import create_dispatcher
from moeserve.kernels.triton.peer_copy import owner_mask

# H200 NVLink 4: NV18 (18 links) ≈ 478 GB/s per direction, the figure the EP issue measures against.
NVLINK_PEAK_GBPS_PER_DIR = 478.0
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", nargs="+", default=["a2a", "allgather", "p2p"])
    p.add_argument("--tokens", nargs="+", type=int, default=[128, 1024, 4096], help="per rank")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--world", type=int, default=None, help="ranks (default: GPUs, else 2)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--profile", action="store_true",
                   help="also print rank 0's torch.profiler table per backend at the last size")
    p.add_argument("--mode", choices=["extend", "decode"], default="extend",
                   help="global forward mode passed to dispatch (deepep: normal vs low-latency)")
    p.add_argument("--ll-max-tokens", type=int, default=256,
                   help="deepep low-latency rows only up to this many tokens/rank")
    p.add_argument("--deep-ep-module", default="deep_ep",
                   help="module with DeepEP's Buffer API (tests: fake_deep_ep, the emulation)")
    return p.parse_args(argv)


def _deepep_mode(backend: str) -> str | None:
    """deepep[-MODE] → MODE (deepep alone: auto); None for the other backends."""
    if backend == "deepep":
        return "auto"
    return backend.removeprefix("deepep-") if backend.startswith("deepep-") else None


def _skips(backend: str, tokens: int, args: argparse.Namespace) -> bool:
    """Low-latency DeepEP rows above --ll-max-tokens are left out (its buffers scale with it)."""
    mode = _deepep_mode(backend)
    ll = mode == "low_latency" or (mode == "auto" and args.mode == "decode")
    return ll and tokens > args.ll_max_tokens


def _dispatcher(backend: str, mesh: ParallelMesh, dtype: torch.dtype, args, cache: dict):
    """A new dispatcher per size (p2p, a2a, allgather), one per DeepEP mode for all sizes."""
    mode = _deepep_mode(backend)
    if mode is None:
        return create_dispatcher(backend, mesh, args.experts, args.hidden, dtype,
                                 max_dispatch_tokens_per_rank=max(args.tokens),
                                 max_tokens_per_rank=max(args.tokens))
    if backend not in cache:
        module = None if args.deep_ep_module == "deep_ep" else \
            importlib.import_module(args.deep_ep_module)
        ll_tokens = [t for t in args.tokens if t <= args.ll_max_tokens] or [1]
        cache[backend] = create_dispatcher(
            "deepep", mesh, args.experts, args.hidden, dtype, deepep_mode=mode,
            max_dispatch_tokens_per_rank=max(ll_tokens), deep_ep_module=module)
    return cache[backend]


def _routing(tokens: int, args: argparse.Namespace, device: torch.device, rank: int):
    """Uniform random top-k: x [T, H], ids [T, K], weights [T, K] float32 (summing to 1)."""
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(tokens, args.hidden, generator=g).to(device, DTYPES[args.dtype])
    ids = torch.rand(tokens, args.experts, generator=g).topk(args.topk, dim=1).indices.to(device)
    w = torch.rand(tokens, args.topk, generator=g)
    return x, ids, (w / w.sum(1, keepdim=True)).to(device)


def time_ms(fn: Callable[[], object], device: torch.device, warmup: int, iters: int) -> float:
    """Steady-state time of one call: --iters calls back to back between two timestamps (after
    a barrier), divided by iters, the median over 5 such runs. Back to back, the host launches
    call i+1 while the GPU runs call i, as it does layer after layer in a forward pass; a single
    isolated call would mostly time the host's kernel launches."""
    for _ in range(warmup):
        fn()
    runs = []
    for _ in range(5):
        dist.barrier()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            runs.append(start.elapsed_time(end) / iters)
        else:
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            runs.append((time.perf_counter() - t0) * 1e3 / iters)
    return statistics.median(runs)


def _raw_a2a(x: torch.Tensor, ids: torch.Tensor, args, world: int) -> tuple[Callable, int]:
    """The same rows as a2a dispatch + combine as two bare all_to_all_single: (fn, remote rows
    this rank sends: S + R - 2L)."""
    in_rank = owner_mask(ids, args.experts // world, world)  # [T, ep]
    own = int(in_rank[:, dist.get_rank()].sum())
    send = x[in_rank.t().nonzero()[:, 1]]  # [S, H], grouped by destination
    send_counts = in_rank.sum(0)
    recv_counts = exchange_counts(send_counts, None)
    recv = x.new_empty((sum(recv_counts), x.shape[1]))
    back = torch.empty_like(send)
    sc = send_counts.tolist()

    def fn() -> None:
        dist.all_to_all_single(recv, send, recv_counts, sc)
        dist.all_to_all_single(back, recv, sc, recv_counts)

    return fn, send.shape[0] + recv.shape[0] - 2 * own


def _bench_rank(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world
    device = torch.device("cuda", rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, torch.get_num_threads() // world))
    dist.init_process_group("nccl" if use_cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world)
    g = dist.group.WORLD
    mesh = ParallelMesh(rank=rank, world_size=world, dp_rank=rank, dp_size=world, ep_rank=rank,
                        ep_size=world, device=device, world_group=g, cpu_group=g, ep_group=g)
    mode = ForwardMode.DECODE if args.mode == "decode" else ForwardMode.EXTEND
    rows, deepep = [], {}
    for tokens in args.tokens:
        x, ids, w = _routing(tokens, args, device, rank)
        raw, remote_rows = _raw_a2a(x, ids, args, world)
        nbytes = remote_rows * args.hidden * x.element_size()
        rows.append(("raw all_to_all", tokens, time_ms(raw, device, args.warmup, args.iters),
                     nbytes))
        for backend in args.backend:
            if _skips(backend, tokens, args):
                continue
            d = _dispatcher(backend, mesh, x.dtype, args, deepep)
            counts = [tokens] * world  # known to every rank, as the DP sync makes them

            def step(d=d) -> torch.Tensor:
                out = d.dispatch(x, ids, w, mode, counts)
                return d.combine(out.hidden, out)

            rows.append((backend, tokens, time_ms(step, device, args.warmup, args.iters), nbytes))
            if args.profile and tokens == args.tokens[-1]:
                dist.barrier()
                profile_table(backend, step, device, show=dist.get_rank() == 0)
    _report(rows, world, device, args)
    deepep.clear()  # DeepEP frees its buffers collectively: every rank here, before the group
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def _report(rows: list[tuple], world: int, device: torch.device, args) -> None:
    """Slowest rank's time, rank-averaged GB/s; printed by rank 0."""
    stats = torch.tensor([[ms, b] for _, _, ms, b in rows], dtype=torch.float64, device=device)
    times, nbytes = stats[:, 0].clone(), stats[:, 1].clone()
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    dist.all_reduce(nbytes)
    if dist.get_rank() != 0:
        return
    on_gpu = device.type == "cuda"
    print(f"# {world} ranks on {'GPU, NCCL' if on_gpu else 'CPU, gloo'}: hidden {args.hidden} "
          f"{args.dtype}, {args.experts} experts top-{args.topk}, mode {args.mode}")
    print(f"{'backend':<19} {'tokens/rank':>11} {'time ms':>9} {'GB/s/GPU':>9} {'% peak':>7}"
          f"   (bytes on NVLink, one direction; peak {NVLINK_PEAK_GBPS_PER_DIR:.0f} GB/s)")
    for (name, tokens, _, _), ms, b in zip(rows, times.tolist(), nbytes.tolist()):
        gbps = b / world / (ms * 1e-3) / 1e9
        peak = f"{100 * gbps / NVLINK_PEAK_GBPS_PER_DIR:6.1f}%" if on_gpu else "    n/a"
        print(f"{name:<19} {tokens:>11} {ms:>9.3f} {gbps:>9.2f} {peak:>7}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    world = args.world or (torch.cuda.device_count() if torch.cuda.is_available() else 2)
    if world < 2:
        raise SystemExit("--world must be at least 2 (expert parallelism needs several ranks)")
    mp.spawn(_bench_rank, args=(world, _free_port(), args), nprocs=world)


if __name__ == "__main__":
    main()
