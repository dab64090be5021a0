"""Where p2p dispatch + combine time goes, per kernel, on all GPUs of the machine (one process each).

    python3 scripts/p2p_sweep.py [--tokens 4096] [--configs 16:8192 8:4096]

For each launch setting (warps per program : row elements per program), times (CUDA events, median of 5 runs of 20 back-to-back calls,
slowest rank) the dispatch kernel alone, dispatch + barrier, the combine kernel, the reduce kernel
and the whole dispatcher round trip, and prints the NVLink bytes each moves (rows sent to other
ranks × hidden × 2, one direction) as GB/s per GPU. Routing: uniform random top-8 of 256.
"""

from __future__ import annotations

import argparse
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moeserve.bench.ep import time_ms
from moeserve.distributed import ParallelMesh
from moeserve.ep.dispatcher import create_dispatcher
from moeserve.kernels.triton import peer_copy


def _time(fn) -> float:
    """bench.ep's steady-state time of one call, the slowest rank's."""
    t = torch.tensor([time_ms(fn, torch.device("cuda"), 3, 20)], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _copy_engine(d, x, sent_rows, gb, world) -> tuple[float, float]:
    """For comparison: the same bytes as one dispatch phase moved by cudaMemcpyAsync (the copy
    engines), as one contiguous block per peer, each peer on its own stream."""
    me = dist.get_rank()
    per_peer = sent_rows // (world - 1)
    src = x.repeat(-(-per_peer // x.shape[0]), 1)[:per_peer]
    dsts = [d.views["x0", r][me * x.shape[0] : me * x.shape[0] + per_peer]
            for r in range(world) if r != me]
    streams = [torch.cuda.Stream() for _ in dsts]

    def fn():
        main = torch.cuda.current_stream()
        for s_, dst in zip(streams, dsts):
            s_.wait_stream(main)
            with torch.cuda.stream(s_):
                dst.copy_(src)
        for s_ in streams:
            main.wait_stream(s_)

    ms_ = _time(fn)
    return ms_, gb / ms_ * 1e3


def _host_costs(d, mesh, e, k, h, dev, world) -> list[tuple[str, float]]:
    """Per-call wall time when the GPU has little to do: what the host spends launching."""
    import time

    t = 128
    x = torch.randn(t, h, device=dev, dtype=torch.bfloat16)
    ids = torch.rand(t, e, device=dev).topk(k, dim=1).indices
    w = torch.full((t, k), 1.0 / k, device=dev)
    counts = [t] * world
    slot, me = d.calls % 2, mesh.ep_rank
    xs, ms = d._all(f"x{slot}"), d._all(f"meta{slot}")

    def full():
        o = d.dispatch(x, ids, w, None, counts)
        d.combine(o.hidden, o)

    fns = [("dispatcher round trip", full),
           ("dispatch_rows launch", lambda: peer_copy.dispatch_rows(x, ids, w, xs, ms, me, t,
                                                                     e // world)),
           ("received_view", lambda: peer_copy.received_view(ms[me][: world * t], 0, e // world)),
           ("barrier", d.buffers.barrier),
           ("torch add (reference)", lambda: x.add(1))]
    out = []
    for name, fn in fns:
        for _ in range(3):
            fn()
        dist.barrier()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        out.append((name, (time.perf_counter() - t0) / 50 * 1e6))
    return out


def _rank(rank: int, world: int, port: int, args) -> None:
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, device_id=dev)
    g = dist.group.WORLD
    mesh = ParallelMesh(rank=rank, world_size=world, dp_rank=rank, dp_size=world, ep_rank=rank,
                        ep_size=world, device=dev, world_group=g, cpu_group=g, ep_group=g)
    t, h, e, k = args.tokens, 7168, 256, 8
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(t, h, generator=gen).to(dev, torch.bfloat16)
    ids = torch.rand(t, e, generator=gen).topk(k, dim=1).indices.to(dev)
    w = torch.softmax(torch.rand(t, k, generator=gen), 1).to(dev)
    d = create_dispatcher("p2p", mesh, e, h, torch.bfloat16, max_tokens_per_rank=t)
    counts = [t] * world
    need = peer_copy.owner_mask(ids, e // world, world)
    sent = need.sum().item() - need[:, rank].sum().item()
    recv_rows = torch.tensor([float(sent)], device=dev)
    dist.all_reduce(recv_rows)
    gb = recv_rows.item() / world * h * 2 / 1e9  # mean remote rows per rank, one direction
    out = d.dispatch(x, ids, w, None, counts)
    hdl = out.handle
    slot = hdl.slot
    me = rank
    rows = []
    for config in args.configs:
        warps, chunk = map(int, config.split(":"))
        peer_copy.NUM_WARPS, peer_copy.ROW_CHUNK = warps, chunk
        xs, ms, ys = d._all(f"x{slot}"), d._all(f"meta{slot}"), d._all(f"y{slot}")
        meta = d.views[f"meta{slot}", me][: world * t]
        y = out.hidden.contiguous()
        parts = d.views[f"y{slot}", me][: world * t].view(world, t, h)

        def disp():
            peer_copy.dispatch_rows(x, ids, w, xs, ms, me, t, e // world)

        def disp_bar():
            disp()
            d.buffers.barrier()

        def comb():
            peer_copy.combine_rows(y, meta, ys, me, t, me * (e // world), e // world)

        def red():
            peer_copy.reduce_parts(parts, y[me * t : me * t + t], ids, me, e // world,
                                   torch.bfloat16)

        def full():
            o = d.dispatch(x, ids, w, None, counts)
            d.combine(o.hidden, o)

        for name, fn, nbytes in [("dispatch kernel", disp, gb), ("dispatch+barrier", disp_bar, gb),
                                 ("combine kernel", comb, gb), ("reduce kernel", red, 0),
                                 ("barrier", d.buffers.barrier, 0),
                                 ("dispatcher round trip", full, 2 * gb)]:
            ms_ = _time(fn)
            rows.append((config, name, ms_, nbytes / ms_ * 1e3 if nbytes else 0.0))
    rows.append(("copy engine", f"{world - 1} peers, 1 stream each",
                 *_copy_engine(d, x, sent, gb, world)))
    host = _host_costs(d, mesh, e, k, h, dev, world)
    if rank == 0:
        print(f"# p2p sweep: {world} GPUs, {t} tokens/rank, hidden 7168 bf16, top-8 of 256; "
              f"{gb * 1e3:.1f} MB per phase per GPU on NVLink")
        print(f"{'config':>10} {'step':<24} {'ms':>8} {'GB/s/GPU':>9} {'% 478':>6}")
        for config, name, ms_, gbps in rows:
            print(f"{config:>10} {name:<24} {ms_:>8.3f} {gbps:>9.1f} {100 * gbps / 478:>5.1f}%")
        print("# host time per call (µs), 128 tokens/rank, 50 calls back to back, then one sync")
        for name, us in host:
            print(f"{name:<32} {us:>8.1f}")
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--configs", nargs="+", default=["16:8192", "8:4096"],
                   help="warps per program:row elements per program")
    args = p.parse_args()
    world = torch.cuda.device_count()
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(world, port, args), nprocs=world)


if __name__ == "__main__":
    main()
