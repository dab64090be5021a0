"""KV transfer bandwidth of PD disaggregation against the transfer engine's own.

    python -m moeserve.bench.pd_transfer [--layers 61 --slot-bytes 1152 --tokens 512 2048 8192]

Two Mooncake engines in one process (TCP here; RDMA/NVLink where the hardware has them). The
source slots of each prompt come from a busy prefill server's allocator (`churned`: prompts of
64-4096 tokens prefilled into a pool, their whole pages cached and partial last page freed at
once, evicted whole, oldest first, when room runs out: what CacheManager and its radix cache do
with distinct prompts), allocated two ways: `fifo` (the free list's head,
`alloc`: what a prefill server did before) and `runs` (`alloc_contiguous`: what it does now). The
destination is one run (a decode server's `alloc_contiguous`). Moved as `KVRegions.byte_ranges`
straight from the pool (one range per source run per layer buffer), `fifo` also through the gather
stage (`staged`), and as the reference `raw`: the same bytes as one range per layer buffer, nothing
gathered (the engine's best case). Default shape: DeepSeek-V3's MLA latent (576 bf16 = 1152 bytes
per token per layer, 61 layers). Prints a table; the ratios are shares of the raw bandwidth.
`--nixl`: a second table, the same slots through two NIXL agents (UCX), if NIXL is installed.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch

from moeserve.config import DisaggregationConfig
from moeserve.disaggregation.mooncake import MooncakeTransfer
from moeserve.disaggregation.regions import KVRegions
from moeserve.disaggregation.staging import GatherStage
from moeserve.kvcache.allocator import TokenToKVPoolAllocator


def churned(size: int, contiguous: bool, page: int, gen: torch.Generator, prompts: int = 400
            ) -> TokenToKVPoolAllocator:
    """An allocator after `prompts` prompts of 64-4096 tokens went through a pool of `size`
    slots: each prompt's whole pages cached (its partial last page freed at once, as
    CacheManager.release does), evicted whole, oldest first, when room ran out."""
    alloc, cached = TokenToKVPoolAllocator(size), collections.deque()
    for n in torch.randint(64, 4097, (prompts,), generator=gen).tolist():
        while alloc.available_size() < n:
            alloc.free(cached.popleft())
        slots = alloc.alloc_contiguous(n) if contiguous else alloc.alloc(n)
        alloc.free(slots[n // page * page:])
        cached.append(slots[: n // page * page])
    while alloc.available_size() < size // 2:
        alloc.free(cached.popleft())
    return alloc


def timed(fns: dict, repeat: int) -> dict[str, float]:
    """Median seconds of each fn, the fns interleaved round by round (this host's load drifts:
    timing one after the other would compare different moments)."""
    for fn in fns.values():
        fn()  # warm: connection and segment lookups
    secs: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeat):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            secs[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in secs.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--slot-bytes", type=int, default=1152)
    ap.add_argument("--tokens", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--page-size", type=int, default=64, help="the prefill's cache.page_size")
    ap.add_argument("--nixl", action="store_true", help="also through NIXL (UCX), if installed")
    ap.add_argument("--pool", type=int, default=0, help="source pool slots (3x the longest)")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--staging-mb", type=int, default=64)
    args = ap.parse_args()
    pool = args.pool or 3 * max(args.tokens)
    src = [torch.randint(0, 256, (pool + 1, args.slot_bytes), dtype=torch.uint8)
           for _ in range(args.layers)]
    dst = [torch.zeros(max(args.tokens) + 1, args.slot_bytes, dtype=torch.uint8)
           for _ in range(args.layers)]
    cfg = DisaggregationConfig()
    a, b = MooncakeTransfer(cfg), MooncakeTransfer(cfg)
    for t in src:
        a.register(t.data_ptr(), t.nbytes)
    for t in dst:
        b.register(t.data_ptr(), t.nbytes)
    regions, gen = KVRegions.of(src), torch.Generator().manual_seed(0)
    stage = GatherStage(src, a, args.staging_mb << 20)
    dst_ptrs = [t.data_ptr() for t in dst]
    print(f"Mooncake over {a.protocol}: {args.layers} buffers x {args.slot_bytes} B/slot, "
          f"source pool {pool} slots after churn, page size {args.page_size}")
    print(f"{'tokens':>7} {'MB':>6} {'fifo rg':>7} {'runs rg':>7} {'fifo':>6} {'staged':>6} "
          f"{'runs':>6} {'raw':>6} {'fifo/raw':>8} {'staged/raw':>10} {'runs/raw':>8}  (GB/s)")
    picked = {}
    for n in args.tokens:
        fifo = churned(pool, False, args.page_size, gen).alloc(n).tolist()
        runs = churned(pool, True, args.page_size, gen).alloc_contiguous(n).tolist()
        picked[n] = (fifo, runs)
        d_slots = list(range(1, n + 1))
        nbytes = n * args.slot_bytes * args.layers
        count, fns = {}, {}
        for name, s_slots in (("fifo", fifo), ("runs", runs)):
            count[name] = len(regions.byte_ranges(s_slots, dst_ptrs, d_slots)[0])
            for t in dst:
                t.zero_()
            a.write(b.address, *regions.byte_ranges(s_slots, dst_ptrs, d_slots))
            assert all(torch.equal(d[1: n + 1], s[torch.tensor(s_slots)])
                       for s, d in zip(src, dst))
            fns[name] = lambda s=s_slots, d=d_slots: a.write(
                b.address, *regions.byte_ranges(s, dst_ptrs, d))
        fns["staged"] = lambda f=fifo, d=d_slots: stage.write(a, b.address, f, dst_ptrs, d)
        for t in dst:
            t.zero_()
        fns["staged"]()
        assert all(torch.equal(d[1: n + 1], s[torch.tensor(fifo)]) for s, d in zip(src, dst))
        raw = ([t.data_ptr() + args.slot_bytes for t in src],
               [p + args.slot_bytes for p in dst_ptrs], [n * args.slot_bytes] * args.layers)
        fns["raw"] = lambda r=raw: a.write(b.address, *r)
        secs = timed(fns, args.repeat)
        ref = secs["raw"]
        gbs = {k: nbytes / v / 1e9 for k, v in secs.items()}
        print(f"{n:>7} {nbytes / 1e6:>6.0f} {count['fifo']:>7} {count['runs']:>7} "
              f"{gbs['fifo']:>6.2f} {gbs['staged']:>6.2f} {gbs['runs']:>6.2f} "
              f"{nbytes / ref / 1e9:>6.2f} {ref / secs['fifo']:>8.0%} "
              f"{ref / secs['staged']:>10.0%} {ref / secs['runs']:>8.0%}")

    if args.nixl:
        nixl_table(args, src, dst, regions, picked)


def nixl_table(args, src, dst, regions: KVRegions, picked: dict) -> None:
    """The same slot lists through two NIXL agents (UCX), against NIXL's own raw figure."""
    from moeserve.disaggregation.nixl import NixlTransfer

    a, b = NixlTransfer(DisaggregationConfig()), NixlTransfer(DisaggregationConfig())
    for t in src:
        a.register(t.data_ptr(), t.nbytes)
    for t in dst:
        b.register(t.data_ptr(), t.nbytes)
    dst_ptrs = [t.data_ptr() for t in dst]
    print("NIXL over UCX, same buffers and slots")
    print(f"{'tokens':>7} {'MB':>6} {'fifo':>6} {'runs':>6} {'raw':>6} {'fifo/raw':>8} "
          f"{'runs/raw':>8}  (GB/s)")
    for n, (fifo, runs) in picked.items():
        d_slots = list(range(1, n + 1))
        nbytes = n * args.slot_bytes * args.layers
        fns = {k: lambda s=s_slots, d=d_slots: a.write(
            b.address, *regions.byte_ranges(s, dst_ptrs, d)) for k, s_slots in
            (("fifo", fifo), ("runs", runs))}
        for t in dst:
            t.zero_()
        fns["fifo"]()
        assert all(torch.equal(d[1: n + 1], s[torch.tensor(fifo)]) for s, d in zip(src, dst))
        raw = ([t.data_ptr() + args.slot_bytes for t in src],
               [p + args.slot_bytes for p in dst_ptrs], [n * args.slot_bytes] * args.layers)
        fns["raw"] = lambda r=raw: a.write(b.address, *r)
        secs = timed(fns, args.repeat)
        print(f"{n:>7} {nbytes / 1e6:>6.0f} {nbytes / secs['fifo'] / 1e9:>6.2f} "
              f"{nbytes / secs['runs'] / 1e9:>6.2f} {nbytes / secs['raw'] / 1e9:>6.2f} "
              f"{secs['raw'] / secs['fifo']:>8.0%} {secs['raw'] / secs['runs']:>8.0%}")
    a.close()
    b.close()

if __name__ == "__main__":
    main()
