"""scheduler.cpus: the CPU list syntax, each local rank's share, and the pin itself."""

from __future__ import annotations

import os
import threading

import pytest

from moeserve.procs.affinity import parse_cpu_list, pin_rank, rank_cpus


def test_cpu_lists_parse_like_taskset():
    assert parse_cpu_list("0") == [0]
    assert parse_cpu_list("0,2-4, 7") == [0, 2, 3, 4, 7]
    for bad in ("", "a", "3-1", "1-", "-1"):
        with pytest.raises(ValueError):
            parse_cpu_list(bad)


def test_ranks_get_equal_contiguous_shares():
    assert [rank_cpus("0-7", r, 4) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert rank_cpus("4-6", 1, 2) == [5]  # the odd core is left out
    assert rank_cpus("3", 1, 2) == [3]  # fewer cores than ranks: they share


def test_pin_moves_the_calling_thread_and_its_new_threads():
    core = min(os.sched_getaffinity(0))
    seen = {}

    def rank_main():
        pin_rank(str(core), 0, 1)
        seen["self"] = os.sched_getaffinity(0)
        child = threading.Thread(target=lambda: seen.update(child=os.sched_getaffinity(0)))
        child.start()
        child.join()

    t = threading.Thread(target=rank_main)
    t.start()
    t.join()
    assert seen == {"self": {core}, "child": {core}}
    before = os.sched_getaffinity(0)
    pin_rank(None, 0, 1)
    assert os.sched_getaffinity(0) == before
    with pytest.raises(SystemExit, match="scheduler.cpus=4096: cannot pin"):
        pin_rank("4096", 0, 1)
    assert os.sched_getaffinity(0) == before
