"""torch.profiler tables for the benchmarks' `--profile` flags: where one call spends host time
(launches, syncs) and device time."""

from __future__ import annotations

from collections.abc import Callable

import torch


def profile_table(name: str, fn: Callable[[], object], device: torch.device, calls: int = 3,
                  show: bool = True, rows: int = 40) -> None:
    """Run `fn` `calls` times under the profiler; print its ops by self CPU time and, on CUDA, by
    self device time (`show=False`: run only, e.g. on ranks other than 0 of a collective)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(calls):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    if not show:
        return
    keys = ["self_cpu_time_total"] + (["self_device_time_total"] if device.type == "cuda" else [])
    for key in keys:
        print(f"## profile: {name}, {calls} calls, by {key}\n" + prof.key_averages().table(
            sort_by=key, row_limit=rows, max_name_column_width=48), flush=True)
