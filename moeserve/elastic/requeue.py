"""A rank's requests back to its queue after a step that did not complete (a failed collective,
or a regroup): the retraction path of scheduler/decode.py, for every request at once.

The KV written by the interrupted step cannot be trusted and the prefix cache may point at it,
so the KV memory is reset whole: every request keeps its prompt and the tokens it already
streamed, and is prefilled again from them (greedy outputs stay the same: docs/elastic_ep.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from moeserve.scheduler.cache import CacheManager

if TYPE_CHECKING:
    from moeserve.scheduler.scheduler import Scheduler


def requeue_all(sched: Scheduler) -> int:
    """→ how many running (or prefilling) requests went back to the queue."""
    active = list(sched.running) + ([sched.chunked] if sched.chunked is not None else [])
    waiting = [r for r in sched.waiting if r not in active]
    for req in active + waiting:
        req.epoch += 1  # results of the interrupted step are dropped
        req.req_pool_idx, req.last_node = None, None
        req.kv_len, req.prefix_len, req.kv_slots = 0, 0, []
        req.device_len = len(req.fill_ids)
    for req in active:
        req.retractions += 1
    sched.running, sched.chunked = [], None
    sched.waiting = [r for r in active + waiting if not r.finished]
    memory = sched.runner.memory
    memory.allocator.clear()
    memory.req_to_token.free([r for r in range(memory.req_to_token.size)
                              if r not in memory.req_to_token._free])
    sched.cache = CacheManager(memory, sched.cfg.cache.page_size,
                               sched.cfg.scheduler.disable_radix_cache)
    sched._global_idle = False
    return len(active)
