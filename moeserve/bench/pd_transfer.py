"""KV transfer bandwidth of PD disaggregation against the transfer engine's own.

    python -m moeserve.bench.pd_transfer [--layers 61 --slot-bytes 1152 --tokens 512 2048 8192]

Two Mooncake engines in one process (TCP here; RDMA/NVLink where the hardware has them). For each
prompt length it moves one prompt's KV from source slots fragmented into runs of `--run` (what a
busy prefill server holds) into one run of destination slots (what a decode server allocates,
kvcache/allocator.py: alloc_contiguous), three ways: `direct` (KVRegions.byte_ranges straight from
the pool: one range per run per layer buffer), `staged` (the prefill role's path: GatherStage
packs the slots into a registered buffer, then one range per layer buffer and chunk), and, as the
reference, `raw`: the same bytes as one contiguous range per layer buffer, nothing gathered (the
engine's best case). Default shape: DeepSeek-V3's MLA latent (576 bf16 = 1152 bytes per token per
layer, 61 layers). Prints a table; the ratios are shares of the raw bandwidth.
"""

from __future__ import annotations

import argparse
import time

import torch

from moeserve.config import DisaggregationConfig
from moeserve.disaggregation.mooncake import MooncakeTransfer
from moeserve.disaggregation.regions import KVRegions
from moeserve.disaggregation.staging import GatherStage


def fragmented_slots(n: int, pool: int, run: int, gen: torch.Generator) -> list[int]:
    """n slots in runs of `run` at random places of a pool (what a busy allocator hands out)."""
    starts = torch.randperm(pool // run, generator=gen)[: -(-n // run)] * run + 1
    return [int(s) + k for s in starts.tolist() for k in range(run)][:n]


def timed(fn, repeat: int) -> float:
    fn()  # warm: connection and segment lookups
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t0) / repeat


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--slot-bytes", type=int, default=1152)
    ap.add_argument("--tokens", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--run", type=int, default=64, help="slots per contiguous run (src side)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--staging-mb", type=int, default=64)
    args = ap.parse_args()
    pool = max(args.tokens) * 2
    src = [torch.randint(0, 256, (pool + 1, args.slot_bytes), dtype=torch.uint8)
           for _ in range(args.layers)]
    dst = [torch.zeros(pool + 1, args.slot_bytes, dtype=torch.uint8) for _ in range(args.layers)]
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
          f"src runs of {args.run} slots")
    print(f"{'tokens':>7} {'MB':>7} {'ranges':>7} {'direct':>7} {'staged':>7} {'raw':>6} "
          f"{'direct/raw':>10} {'staged/raw':>10}  (GB/s)")
    for n in args.tokens:
        s_slots = fragmented_slots(n, pool, args.run, gen)
        d_slots = list(range(1, n + 1))
        ranges = regions.byte_ranges(s_slots, dst_ptrs, d_slots)
        nbytes = sum(ranges[2])
        raw = ([t.data_ptr() + args.slot_bytes for t in src],
               [p + args.slot_bytes for p in dst_ptrs], [n * args.slot_bytes] * args.layers)
        direct = timed(lambda s=s_slots, d=d_slots: a.write(
            b.address, *regions.byte_ranges(s, dst_ptrs, d)), args.repeat)
        for t in dst:
            t.zero_()
        staged = timed(lambda s=s_slots, d=d_slots: stage.write(a, b.address, s, dst_ptrs, d),
                       args.repeat)
        assert all(torch.equal(d[1: n + 1], s[torch.tensor(s_slots)]) for s, d in zip(src, dst))
        ref = timed(lambda r=raw: a.write(b.address, *r), args.repeat)
        print(f"{n:>7} {nbytes / 1e6:>7.1f} {len(ranges[0]):>7} {nbytes / direct / 1e9:>7.2f} "
              f"{nbytes / staged / 1e9:>7.2f} {nbytes / ref / 1e9:>6.2f} {ref / direct:>10.0%} "
              f"{ref / staged:>10.0%}")


if __name__ == "__main__":
    main()
