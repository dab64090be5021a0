"""KV transfer bandwidth of PD disaggregation against the transfer engine's own.

    python -m moeserve.bench.pd_transfer [--layers 61 --slot-bytes 1152 --tokens 512 2048 8192]

Two Mooncake engines in one process (TCP here; RDMA/NVLink where the hardware has them). For each
prompt length it moves one prompt's KV the way the prefill role does (KVRegions.byte_ranges over
the request's slots, one batched write: slots come from a used allocator, so they are fragmented
into runs) and, as the reference, the same number of bytes as one contiguous range per layer
buffer (the engine's best case). Default shape: DeepSeek-V3's MLA latent (576 bf16 = 1152 bytes
per token per layer, 61 layers). Prints a table; the ratio is the share of the raw bandwidth.
"""

from __future__ import annotations

import argparse
import time

import torch

from moeserve.config import DisaggregationConfig
from moeserve.disaggregation.mooncake import MooncakeTransfer
from moeserve.disaggregation.regions import KVRegions


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
    args = ap.parse_args()
    pool = max(args.tokens) * 2
    src = [torch.zeros(pool + 1, args.slot_bytes, dtype=torch.uint8) for _ in range(args.layers)]
    dst = [torch.zeros(pool + 1, args.slot_bytes, dtype=torch.uint8) for _ in range(args.layers)]
    cfg = DisaggregationConfig()
    a, b = MooncakeTransfer(cfg), MooncakeTransfer(cfg)
    for t in src:
        a.register(t.data_ptr(), t.nbytes)
    for t in dst:
        b.register(t.data_ptr(), t.nbytes)
    regions, gen = KVRegions.of(src), torch.Generator().manual_seed(0)
    dst_ptrs = [t.data_ptr() for t in dst]
    print(f"Mooncake over {a.protocol}: {args.layers} buffers x {args.slot_bytes} B/slot, "
          f"src runs of {args.run} slots")
    print(f"{'tokens':>7} {'MB':>8} {'ranges':>7} {'PD GB/s':>8} {'raw GB/s':>9} {'PD/raw':>7}")
    for n in args.tokens:
        s_slots = fragmented_slots(n, pool, args.run, gen)
        d_slots = list(range(1, n + 1))
        ranges = regions.byte_ranges(s_slots, dst_ptrs, d_slots)
        nbytes = sum(ranges[2])
        raw = ([t.data_ptr() + args.slot_bytes for t in src],
               [p + args.slot_bytes for p in dst_ptrs], [n * args.slot_bytes] * args.layers)
        pd = timed(lambda s=s_slots, d=d_slots: a.write(
            b.address, *regions.byte_ranges(s, dst_ptrs, d)), args.repeat)
        ref = timed(lambda r=raw: a.write(b.address, *r), args.repeat)
        assert torch.equal(dst[0][1 : n + 1], src[0][torch.tensor(s_slots)])
        print(f"{n:>7} {nbytes / 1e6:>8.1f} {len(ranges[0]):>7} {nbytes / pd / 1e9:>8.2f} "
              f"{nbytes / ref / 1e9:>9.2f} {ref / pd:>7.0%}")


if __name__ == "__main__":
    main()
