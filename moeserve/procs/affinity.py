"""CPU affinity of a server's scheduler ranks (`scheduler.cpus`), apart from its HTTP, tokenizer and
detokenizer processes.

On a CPU host a rank's loop is its critical path: every other process on its cores takes turns
with it. `taskset` on the launcher pins the whole server; `scheduler.cpus` then moves the ranks
alone to their own cores (split evenly among the node's ranks), leaving the front end where the
launcher runs. docs/disaggregation.md measures why a PD decode server wants this.
"""

from __future__ import annotations

import os


def parse_cpu_list(text: str) -> list[int]:
    """`taskset -c` syntax ("0", "0,2", "4-7", "0-3,8"); ValueError when malformed or empty."""
    cpus: list[int] = []
    for part in text.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"{text!r} is not a CPU list like 0,2-3")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ValueError(f"{part!r}: range ends before it starts")
        cpus += [c for c in range(first, last + 1) if c not in cpus]
    return cpus


def rank_cpus(text: str, local_rank: int, local_ranks: int) -> list[int]:
    """Local rank `local_rank`'s share of the list: equal contiguous parts (a rank gets the whole
    list when there are fewer cores than ranks)."""
    cpus = parse_cpu_list(text)
    if len(cpus) < local_ranks:
        return cpus
    share = len(cpus) // local_ranks
    return cpus[local_rank * share:(local_rank + 1) * share]


def pin_rank(text: str | None, local_rank: int, local_ranks: int) -> None:
    """Pin the calling thread (a scheduler rank's main thread, at start) to its share; the
    threads it starts afterwards (forward, transfer, control link) inherit it."""
    if text is None:
        return
    cpus = rank_cpus(text, local_rank, local_ranks)
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as e:
        raise SystemExit(f"scheduler.cpus={text}: cannot pin rank {local_rank} to CPUs {cpus} "
                         f"({e}; this host has {os.cpu_count()})") from None
