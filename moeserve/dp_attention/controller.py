"""The DataParallelController: routes requests to data-parallel attention ranks.

`Router` is the pure routing core (no sockets, unit-testable):
- round_robin: ranks in turn;
- shortest_queue: least running + waiting from each rank's latest LoadReport, plus the requests
  routed to it since that report (so a burst between two reports spreads over the ranks);
- prefix_aware: the rank whose approximate prefix index holds the longest leading run of the
  prompt's token blocks, unless its load exceeds the least-loaded rank's by more than `margin`
  (then, and when no rank holds a prefix, the least-loaded rank).
A request may pin `dp_rank`; out-of-range values are refused. Under elastic EP a rank may be
marked down (`set_alive`): no policy picks it, and a pin to it is refused.

`DataParallelController` is the process around it: PULL SchedulerInput on scheduler_in and
LoadReport on controller_in, PUSH to each rank's rank_in. A routed GenerateReq wakes every other
rank (`Wake`), so all ranks leave their idle wait and meet at the next lockstep all-gather at once.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from moeserve.config import DP_POLICIES, MoeserveConfig
from moeserve.ipc.messages import (AbortReq, ControlReq, GenerateReq, LoadReport, RankDown,
                                   RankUp, ReadyMsg, Regroup, RequestsLost, SchedulerInput,
                                   TokenOutput, TokenOutputBatch, Wake)
from moeserve.ipc.queues import Endpoints, PullQueue, PushQueue

logger = logging.getLogger(__name__)

PREFIX_BLOCK_TOKENS = 16
PREFIX_INDEX_BLOCKS = 1 << 16  # per rank, LRU-bounded
ABORT_MAP_SIZE = 1 << 16  # rid → rank entries kept for aborts


def block_hashes(input_ids: Sequence[int], block: int) -> list[int]:
    """Chained hashes of the prompt's full `block`-token blocks: h[i] identifies ids[: (i+1)*block]."""
    out: list[int] = []
    h = 0
    for start in range(0, len(input_ids) - block + 1, block):
        h = hash((h, tuple(input_ids[start : start + block])))
        out.append(h)
    return out


class PrefixIndex:
    """Approximate content of one rank's radix cache: chained block hashes with LRU eviction."""

    def __init__(self, capacity: int = PREFIX_INDEX_BLOCKS):
        self.capacity = capacity
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, hashes: Sequence[int]) -> int:
        """Number of leading blocks present (they become most recently used)."""
        n = 0
        for h in hashes:
            if h not in self._blocks:
                break
            self._blocks.move_to_end(h)
            n += 1
        return n

    def insert(self, hashes: Sequence[int]) -> None:
        for h in hashes:
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)


class Router:
    """Chooses a data-parallel rank for each request (see the module docstring)."""

    def __init__(self, dp_size: int, policy: str = "round_robin", margin: int = 4,
                 block_tokens: int = PREFIX_BLOCK_TOKENS, index_blocks: int = PREFIX_INDEX_BLOCKS):
        if policy not in DP_POLICIES:
            raise ValueError(f"unknown dp policy {policy!r}; choose from {list(DP_POLICIES)}")
        self.dp_size, self.policy, self.margin = dp_size, policy, margin
        self.block_tokens = block_tokens
        self.reported = [0] * dp_size  # running + waiting at the latest report
        self.routed_since = [0] * dp_size  # routed after that report
        self.indexes = [PrefixIndex(index_blocks) for _ in range(dp_size)]
        self.alive = [True] * dp_size  # elastic EP: False while a rank is down
        self._turn = itertools.count()
        self._policies: dict[str, Callable[[Sequence[int]], int]] = {
            "round_robin": lambda ids: self._next_turn(),
            "shortest_queue": lambda ids: self.least_loaded(),
            "prefix_aware": self._prefix_aware}

    def load(self, dp_rank: int) -> int:
        return self.reported[dp_rank] + self.routed_since[dp_rank]

    def live_ranks(self) -> list[int]:
        return [r for r in range(self.dp_size) if self.alive[r]]

    def set_alive(self, dp_rank: int, alive: bool) -> None:
        self.alive[dp_rank] = alive
        self.reported[dp_rank] = self.routed_since[dp_rank] = 0

    def _next_turn(self) -> int:
        live = self.live_ranks()
        return live[next(self._turn) % len(live)]

    def least_loaded(self) -> int:
        return min(self.live_ranks(), key=self.load)  # ties: the lowest rank

    def on_report(self, dp_rank: int, running: int, waiting: int) -> None:
        self.reported[dp_rank] = running + waiting
        self.routed_since[dp_rank] = 0

    def route(self, input_ids: Sequence[int], dp_rank: int | None = None) -> int:
        """The rank for a prompt; raises ValueError for a pinned rank out of range."""
        if dp_rank is not None and not 0 <= dp_rank < self.dp_size:
            raise ValueError(f"dp_rank {dp_rank} is out of range [0, {self.dp_size})")
        if dp_rank is not None and not self.alive[dp_rank]:
            raise ValueError(f"dp_rank {dp_rank} is down (its process died)")
        if not any(self.alive):
            raise ValueError("no data-parallel rank is alive")
        rank = self._policies[self.policy](input_ids) if dp_rank is None else dp_rank
        self.routed_since[rank] += 1
        if self.policy == "prefix_aware":
            self.indexes[rank].insert(block_hashes(input_ids, self.block_tokens))
        return rank

    def _prefix_aware(self, input_ids: Sequence[int]) -> int:
        hashes = block_hashes(input_ids, self.block_tokens)
        matched = [index.match(hashes) for index in self.indexes]
        best = max(self.live_ranks(), key=lambda r: (matched[r], -self.load(r)))
        lightest = self.least_loaded()
        if matched[best] == 0 or self.load(best) - self.load(lightest) > self.margin:
            return lightest
        return best


class RidMap:
    """rid → rank of the most recent `capacity` routed requests (finishes are not visible here)."""

    def __init__(self, capacity: int = ABORT_MAP_SIZE):
        self.capacity = capacity
        self._map: OrderedDict[str, int] = OrderedDict()

    def add(self, rid: str, rank: int) -> None:
        self._map[rid] = rank
        if len(self._map) > self.capacity:
            self._map.popitem(last=False)

    def pop(self, rid: str) -> int | None:
        return self._map.pop(rid, None)

    def rids_of(self, rank: int) -> list[str]:
        """The remembered rids routed to `rank` (some may have finished)."""
        return [rid for rid, r in self._map.items() if r == rank]


class DataParallelController:
    def __init__(self, cfg: MoeserveConfig, endpoints: Endpoints):
        p = cfg.parallel
        self.ctx = zmq.Context()
        self.inbox: PullQueue = PullQueue(self.ctx, endpoints.scheduler_in, SchedulerInput)
        self.reports: PullQueue = PullQueue(self.ctx, endpoints.controller_in, LoadReport)
        self.rank_addresses = endpoints.rank_in
        self.ranks = [PushQueue(self.ctx, addr) for addr in endpoints.rank_in]
        self.to_detok = PushQueue(self.ctx, endpoints.detokenizer_in)
        self.to_manager = PushQueue(self.ctx, endpoints.manager_in)
        self.router = Router(p.dp_size, p.dp_policy, p.prefix_aware_margin)
        self.ranks_per_dp = p.attn_tp_size
        self.rids = RidMap()
        self._routed_to: set[int] = set()  # ranks that got a request in the current drain
        self.poller = zmq.Poller()
        self.poller.register(self.inbox.socket, zmq.POLLIN)
        self.poller.register(self.reports.socket, zmq.POLLIN)
        self._handlers: dict[type, Callable[[Any], None]] = {
            GenerateReq: self.on_generate, AbortReq: self.on_abort, ControlReq: self.on_control,
            Wake: lambda msg: None, RankDown: self.on_rank_down, RankUp: self.on_rank_up,
            Regroup: lambda msg: None}

    def on_generate(self, req: GenerateReq) -> None:
        try:
            rank = self.router.route(req.input_ids, req.dp_rank)
        except ValueError as e:  # a bad pin fails this request only
            self.to_detok.put(TokenOutputBatch(outputs=[TokenOutput(
                rid=req.rid, new_ids=[], finish_reason="abort",
                prompt_tokens=len(req.input_ids), error=str(e))]))
            return
        self.ranks[rank].put(req)
        self.rids.add(req.rid, rank)
        self._routed_to.add(rank)

    def on_abort(self, req: AbortReq) -> None:
        """To the rank that got the rid; to every rank when it is no longer remembered (ranks
        ignore rids they do not hold)."""
        rank = self.rids.pop(req.rid)
        for r in self.router.live_ranks() if rank is None else [rank]:
            if self.router.alive[r]:
                self.ranks[r].put(req)

    def on_control(self, req: ControlReq) -> None:
        for r in self.router.live_ranks():  # each rank replies to the tokenizer manager itself
            self.ranks[r].put(req)

    def on_rank_down(self, msg: RankDown) -> None:
        """Elastic EP: route around `msg.rank`; what was queued for it is dropped (a relaunched
        process binds the same address), and its requests go back to the tokenizer manager."""
        if not self.router.alive[msg.rank]:
            return
        self.router.set_alive(msg.rank, False)
        self.ranks[msg.rank].close()
        self.ranks[msg.rank] = PushQueue(self.ctx, self.rank_addresses[msg.rank])
        rids = self.rids.rids_of(msg.rank)
        logger.warning("DP rank %d is down (%s): routing around it; %d request(s) it held go "
                       "back for a retry", msg.rank, msg.cause, len(rids))
        self.to_manager.put(RequestsLost(rank=msg.rank, rids=rids, cause=msg.cause))

    def on_rank_up(self, msg: RankUp) -> None:
        self.router.set_alive(msg.rank, True)
        logger.info("DP rank %d serves again", msg.rank)

    def on_report(self, report: LoadReport) -> None:
        self.router.on_report(report.rank // self.ranks_per_dp, report.running, report.waiting)

    def step(self, timeout_ms: int | None = None) -> None:
        """Wait for input, then handle everything queued: reports first, then requests in
        arrival order; ranks that got no request in this round are woken if any other did."""
        if not self.poller.poll(timeout_ms):
            return
        for report in self.reports.get_nowait_all():
            self.on_report(report)
        self._routed_to.clear()
        for msg in self.inbox.get_nowait_all():
            self._handlers[type(msg)](msg)
        if self._routed_to:
            for rank in self.router.live_ranks():
                if rank not in self._routed_to:
                    self.ranks[rank].put(Wake())

    def serve_forever(self) -> None:
        while True:  # NOTE: with a timeout, so a stop request (children.py) is taken at once
            self.step(200)


def run_controller_process(cfg: MoeserveConfig, endpoints: Endpoints) -> None:
    """Process entry: bind the request and load-report inboxes, announce readiness, route."""
    controller = DataParallelController(cfg, endpoints)
    p = cfg.parallel
    info = {"dp_size": p.dp_size, "policy": p.dp_policy, "pid": os.getpid()}
    controller.to_manager.put(ReadyMsg(role="controller", info=info))
    logger.info("DP controller ready: %s", info)
    controller.serve_forever()
