"""The decode role: for each request with a room, reserve a table row and one KV slot per prompt
token, ask the room's prefill rank (found through its bootstrap server) to write the KV there, and
once it has, decode from the first token on as if this server had prefilled.

Failures end exactly the affected requests with an error: a prefill server whose bootstrap server
stops answering (heartbeats), an error reported by the prefill, or no KV within
`waiting_timeout_s`. Slots a prefill may still be writing are not reused until it can no longer
write (its KVDone came, or it is dead, or the timeout passed twice).
"""

from __future__ import annotations

import logging
import queue
import time
from dataclasses import dataclass, field

from moeserve.config import DisaggregationConfig
from moeserve.core import Req
from moeserve.disaggregation.bootstrap import fetch_route, probe
from moeserve.disaggregation.heartbeat import Heartbeats
from moeserve.disaggregation.link import ControlLink
from moeserve.disaggregation.messages import KVDestination, KVDone
from moeserve.disaggregation.regions import KVRegions
from moeserve.disaggregation.role import RoleHost, TransferCounters, wants_pd
from moeserve.disaggregation.transfer import KVTransfer
from moeserve.ipc.messages import Bootstrap

logger = logging.getLogger(__name__)

ROUTE_TIMEOUT_S = 5.0


@dataclass
class _Pending:
    req: Req
    room: int
    bootstrap: tuple[str, int]
    arrived: float
    row: int | None = None
    slots: list[int] = field(default_factory=list)
    asked_at: float = 0.0


@dataclass
class _Outcome:
    room: int
    ok: bool
    error: str | None = None
    first_token: int = -1
    first_logprob: float | None = None
    first_top: list[tuple[int, float]] | None = None
    nbytes: int = 0
    dead_peer: bool = False  # the prefill cannot write any more: slots are free at once
    draft: tuple[list[int], bytes] | None = None  # MTP: the draft's state after the first token


class DecodeRole:
    mode = "decode"

    def __init__(self, cfg: DisaggregationConfig, host: RoleHost, transfer: KVTransfer,
                 max_running: int):
        self.cfg, self.host, self.transfer = cfg, host, transfer
        self.max_running = max_running
        self.regions = KVRegions.of(host.kv_buffers())
        for ptr, n in zip(self.regions.ptrs, self.regions.nbytes):
            transfer.register(ptr, n)
        self.counters = TransferCounters()
        self._pending: dict[int, _Pending] = {}  # room → request waiting for its KV (loop)
        self._queue: list[_Pending] = []  # not yet given slots, in arrival order (loop)
        self._quarantine: dict[int, tuple[int, list[int], float]] = {}  # room → row, slots, until
        self._done: queue.SimpleQueue[_Outcome] = queue.SimpleQueue()
        # link thread only
        self._routes: dict[tuple[str, int], dict] = {}
        self._asked: dict[int, tuple[str, int]] = {}  # room → bootstrap of its prefill
        self.heartbeats = Heartbeats(probe, cfg.heartbeat_interval_s, cfg.heartbeat_max_failures)
        self.link = ControlLink(cfg.host, self._on_message, self._on_tick)

    # ---- scheduler hooks (loop thread) ----------------------------------------------------------
    def info(self) -> dict:
        return {"endpoint": self.link.endpoint, "engine": self.transfer.address,
                "backend": self.transfer.name}

    def stats(self) -> dict:
        """Counters plus the requests still waiting for their KV (a gauge, for /server_info)."""
        return {**self.counters.as_dict(self.mode), "in_flight": len(self._pending)}

    def on_request(self, req: Req, bootstrap: Bootstrap | None) -> bool:
        if not wants_pd(req, bootstrap):
            return False
        room = bootstrap.room
        if room in self._pending:  # a client reusing a room: serve it here, colocated
            logger.warning("bootstrap_room %d already in flight; %s prefills here", room, req.rid)
            return False
        p = _Pending(req, room, (bootstrap.host, bootstrap.port), time.monotonic())
        self._pending[room] = p
        self._queue.append(p)
        return True

    def owns(self, req: Req) -> bool:
        return any(p.req is req for p in self._pending.values())

    def on_finish(self, req: Req) -> bool:
        """An aborted request that still waits for KV: its slots are quarantined while the
        prefill may still write them."""
        p = next((p for p in self._pending.values() if p.req is req), None)
        if p is None:
            return False
        self._drop(p, quarantine=p.asked_at > 0)
        return False

    def on_reject(self, req: Req, bootstrap: Bootstrap | None, error: str) -> None:
        """Rejected here while waiting for its KV (its grammar did not compile): its slots are
        quarantined while the prefill may still write them."""
        self.on_finish(req)

    def poll(self) -> None:
        now = time.monotonic()
        self._apply_outcomes()
        self._expire(now)
        self._reserve(now)
        for room in [r for r, (_, _, t) in self._quarantine.items() if t < now]:
            row, slots, _ = self._quarantine.pop(room)
            self.host.free_kv(row, slots)

    def busy(self) -> bool:
        return bool(self._pending)

    def held_slots(self) -> int:
        return sum(len(p.slots) for p in self._pending.values()) + sum(
            len(s) for _, s, _ in self._quarantine.values())

    def close(self) -> None:
        self.heartbeats.close()
        self.link.close()
        self.transfer.close()

    # ---- loop-thread helpers ---------------------------------------------------------------
    def _reserve(self, now: float) -> None:
        """Rows and slots for queued requests, in arrival order, while they fit."""
        while self._queue:
            p = self._queue[0]
            if p.req.finished:
                self._queue.pop(0)
                continue
            n = len(p.req.input_ids)
            active = len(self._pending) - len(self._queue)
            if active >= self.max_running or not self.host.room_left(n):
                return
            got = self.host.alloc_kv(n)
            if got is None:
                return
            self._queue.pop(0)
            p.row, p.slots = got
            p.asked_at = now
            dest = KVDestination(room=p.room, engine=self.transfer.address,
                                 reply_to=self.link.endpoint, ptrs=self.regions.ptrs,
                                 slot_bytes=self.regions.slot_bytes, slots=p.slots)
            self.link.call(self._ask, p.bootstrap, dest)

    def _apply_outcomes(self) -> None:
        later: list[_Outcome] = []
        while True:
            try:
                out = self._done.get_nowait()
            except queue.Empty:
                break
            p = self._pending.get(out.room)
            if out.ok and p is not None and p.req.sampling.grammar and p.req.grammar is None:
                later.append(out)  # its grammar still compiles: activate once it is attached
                continue
            self._apply(out)
        for out in later:
            self._done.put(out)

    def _apply(self, out: _Outcome) -> None:
        if out.room in self._quarantine:  # whatever the outcome, the prefill writes no more
            row, slots, _ = self._quarantine.pop(out.room)
            self.host.free_kv(row, slots)
            return
        p = self._pending.get(out.room)
        if p is None:
            return
        if out.ok:
            del self._pending[out.room]
            self.counters.ok(out.nbytes, time.monotonic() - p.asked_at)
            self.host.activate(p.req, p.row, p.slots, out.first_token, out.first_logprob,
                               out.first_top, out.draft)
        else:
            self._fail(p, out.error or "KV transfer failed", quarantine=not out.dead_peer)

    def _expire(self, now: float) -> None:
        limit = self.cfg.waiting_timeout_s
        for p in [p for p in self._pending.values() if p.arrived + limit < now]:
            self._fail(p, f"no KV from the prefill server at {p.bootstrap[0]}:{p.bootstrap[1]} "
                       f"for room {p.room} within {limit:.0f} s", quarantine=p.asked_at > 0)

    def _fail(self, p: _Pending, error: str, quarantine: bool) -> None:
        self.counters.failures += 1
        self._drop(p, quarantine)
        logger.warning("request %s failed: %s", p.req.rid, error)
        self.host.fail(p.req, error)

    def _drop(self, p: _Pending, quarantine: bool) -> None:
        self._pending.pop(p.room, None)
        if p in self._queue:
            self._queue.remove(p)
        if p.row is not None:
            if quarantine:
                until = time.monotonic() + self.cfg.waiting_timeout_s
                self._quarantine[p.room] = (p.row, p.slots, until)
            else:
                self.host.free_kv(p.row, p.slots)
            p.row, p.slots = None, []
        if not quarantine:  # a quarantined room stays watched: a dead prefill frees it
            self.link.call(self._asked.pop, p.room, None)

    # ---- link thread ----------------------------------------------------------------------------
    def _ask(self, bootstrap: tuple[str, int], dest: KVDestination) -> None:
        try:
            route = self._routes.get(bootstrap)
            if route is None:
                route = self._routes[bootstrap] = fetch_route(*bootstrap, ROUTE_TIMEOUT_S)
            rank = route["ranks"][str(dest.room % route["dp_size"])]
        except (OSError, ValueError, KeyError) as e:
            self._done.put(_Outcome(dest.room, False, dead_peer=True, error=(
                f"bootstrap server {bootstrap[0]}:{bootstrap[1]} did not answer: {e}")))
            return
        error = self.regions.compatible(rank["slot_bytes"])
        if error is not None:
            self._done.put(_Outcome(dest.room, False, error=error, dead_peer=True))
            return
        self._asked[dest.room] = bootstrap
        self.link.send(rank["endpoint"], dest)

    def _on_message(self, msg) -> None:
        if isinstance(msg, KVDone):
            self._asked.pop(msg.room, None)
            # an error from the prefill: it writes no more, so the slots are free at once
            draft = (None if msg.draft_tokens is None or msg.draft_hidden is None
                     else (msg.draft_tokens, msg.draft_hidden))
            self._done.put(_Outcome(msg.room, msg.ok, msg.error, msg.first_token,
                                    msg.first_logprob, msg.first_top_logprobs, msg.nbytes,
                                    dead_peer=not msg.ok, draft=draft))

    def _on_tick(self, now: float) -> None:
        """Fail the rooms of each prefill server the heartbeat thread declared dead, and forget
        its route (a restarted server has new ranks); then tell it whom to watch."""
        for peer in self.heartbeats.dead():
            self._routes.pop(peer, None)
            for room in [r for r, b in self._asked.items() if b == peer]:
                del self._asked[room]
                self._done.put(_Outcome(room, False, dead_peer=True, error=(
                    f"the prefill server at {peer[0]}:{peer[1]} stopped answering "
                    f"({self.cfg.heartbeat_max_failures} missed heartbeats)")))
        self.heartbeats.watch(frozenset(self._asked.values()))
