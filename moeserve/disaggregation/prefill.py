"""The prefill role: prefill as usual, sample the first token, then write the prompt's KV into the
decode rank that asked for the room, and keep the slots until that write ended or timed out.

Threads: the scheduler's loop (hooks, `poll`) and the link thread (control messages, transfers).
They share only the `_done` queue and the link's call queue.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass

from moeserve.config import DisaggregationConfig
from moeserve.core import Req
from moeserve.disaggregation.link import ControlLink
from moeserve.disaggregation.messages import KVDestination, KVDone
from moeserve.disaggregation.regions import KVRegions
from moeserve.disaggregation.role import RoleHost, TransferCounters, wants_pd
from moeserve.disaggregation.staging import GatherStage, run_count
from moeserve.disaggregation.transfer import KVTransfer, TransferError
from moeserve.ipc.messages import Bootstrap

logger = logging.getLogger(__name__)

STALE_DESTINATION_S = 600.0  # a decode's ask for a room this server never saw is dropped then


@dataclass
class _Ready:
    slots: list[int]
    first_token: int
    first_logprob: float | None
    first_top: list[tuple[int, float]] | None
    deadline: float
    # waits for the request's last step on the device, → the MTP draft's state (RoleHost)
    step_done: Callable[[], tuple[list[int], bytes] | None]


@dataclass
class _Outcome:
    room: int
    ok: bool
    nbytes: int = 0
    seconds: float = 0.0
    error: str | None = None


class PrefillRole:
    mode = "prefill"

    def __init__(self, cfg: DisaggregationConfig, host: RoleHost, transfer: KVTransfer):
        self.cfg, self.host, self.transfer = cfg, host, transfer
        buffers = host.kv_buffers()
        self.regions = KVRegions.of(buffers)
        for ptr, n in zip(self.regions.ptrs, self.regions.nbytes):
            transfer.register(ptr, n)
        self.stage = (GatherStage(buffers, transfer, cfg.staging_mb << 20)
                      if cfg.staging_mb > 0 else None)
        self.counters = TransferCounters()
        self._rooms: dict[str, int] = {}  # rid → room (loop thread)
        self._held: dict[int, Req] = {}  # room → request whose slots wait for the transfer
        self._done: queue.SimpleQueue[_Outcome] = queue.SimpleQueue()
        # link thread only
        self._dests: dict[int, tuple[KVDestination, float]] = {}
        self._ready: dict[int, _Ready] = {}
        self._failed: dict[int, tuple[str, float]] = {}
        self.link = ControlLink(cfg.host, self._on_message, self._on_tick)

    # ---- scheduler hooks (loop thread) ----------------------------------------------------------
    def info(self) -> dict:
        return {"endpoint": self.link.endpoint, "engine": self.transfer.address,
                "backend": self.transfer.name, "slot_bytes": self.regions.slot_bytes}

    def stats(self) -> dict:
        """Counters plus the prefilled requests whose KV is not yet written (a gauge)."""
        return {**self.counters.as_dict(self.mode), "in_flight": len(self._held)}

    def on_request(self, req: Req, bootstrap: Bootstrap | None) -> bool:
        """Prefill it here, generating only the first token; the decode server does the rest."""
        if wants_pd(req, bootstrap):
            self._rooms[req.rid] = bootstrap.room
            req.sampling = dataclasses.replace(req.sampling, max_new_tokens=1)
        return False

    def owns(self, req: Req) -> bool:
        return False

    def on_reject(self, req: Req, bootstrap: Bootstrap | None, error: str) -> None:
        """Rejected before it ran (intake checks, a grammar that did not compile): the decode
        server is told now, with the reason, instead of waiting for its KV until a timeout."""
        room = self._rooms.pop(req.rid, None)
        if room is None and wants_pd(req, bootstrap):
            room = bootstrap.room
        if room is not None:
            self.link.call(self._fail_room, room, f"the prefill server rejected it: {error}")

    def on_finish(self, req: Req) -> bool:
        room = self._rooms.pop(req.rid, None)
        if room is None:
            return False
        if req.finish.type == "abort" or not req.output_ids:
            self.link.call(self._fail_room, room, f"prefill of room {room} was aborted")
            return False
        self._held[room] = req
        lp = req.logprobs[0] if req.return_logprob and req.logprobs else None
        top = req.top_logprobs[0] if lp is not None and req.top_logprobs else None
        ready = _Ready(req.kv_slots[: len(req.input_ids)], req.output_ids[0], lp, top,
                       time.monotonic() + self.cfg.bootstrap_timeout_s, self.host.step_done(req))
        self.link.call(self._on_ready, room, ready)
        return True

    def poll(self) -> None:
        while True:
            try:
                out = self._done.get_nowait()
            except queue.Empty:
                return
            req = self._held.pop(out.room, None)
            if req is not None:
                self.host.release(req)
            if out.ok:
                self.counters.ok(out.nbytes, out.seconds)
            else:
                self.counters.failures += 1
                logger.warning("KV of room %d not sent: %s", out.room, out.error)

    def busy(self) -> bool:
        return False  # held slots are freed at the next poll: nothing to hurry for

    def held_slots(self) -> int:
        return sum(len(r.kv_slots) for r in self._held.values())

    def close(self) -> None:
        self.link.close()
        self.transfer.close()

    # ---- link thread ----------------------------------------------------------------------------
    def _on_message(self, msg) -> None:
        if not isinstance(msg, KVDestination):
            return
        if msg.room in self._failed:
            error, _ = self._failed.pop(msg.room)
            self.link.send(msg.reply_to, KVDone(room=msg.room, ok=False, error=error))
        elif msg.room in self._ready:
            self._send(msg, self._ready.pop(msg.room))
        else:
            self._dests[msg.room] = (msg, time.monotonic())

    def _on_ready(self, room: int, ready: _Ready) -> None:
        dest = self._dests.pop(room, None)
        if dest is None:
            self._ready[room] = ready
        else:
            self._send(dest[0], ready)

    def _fail_room(self, room: int, error: str) -> None:
        dest = self._dests.pop(room, None)
        if dest is None:
            self._failed[room] = (error, time.monotonic())
        else:
            self.link.send(dest[0].reply_to, KVDone(room=room, ok=False, error=error))

    def _send(self, dest: KVDestination, ready: _Ready) -> None:
        t0, nbytes = time.perf_counter(), 0
        error = self.regions.compatible(dest.slot_bytes)
        if error is None and len(dest.slots) != len(ready.slots):
            error = f"decode offered {len(dest.slots)} slots for {len(ready.slots)} tokens"
        draft = ready.step_done() if error is None else None  # also: the KV is all written
        if error is None:
            try:
                nbytes = self._write(dest, ready.slots)
            except TransferError as e:
                error = str(e)
        seconds = time.perf_counter() - t0
        ids, hidden = draft if draft is not None and error is None else (None, None)
        self.link.send(dest.reply_to, KVDone(room=dest.room, ok=error is None, error=error,
                                             first_token=ready.first_token,
                                             first_logprob=ready.first_logprob,
                                             first_top_logprobs=ready.first_top, nbytes=nbytes,
                                             draft_tokens=ids, draft_hidden=hidden))
        self._done.put(_Outcome(dest.room, error is None, nbytes, seconds, error))

    def _write(self, dest: KVDestination, slots: list[int]) -> int:
        """Through the gather stage when our slots are more fragmented than the destination's,
        else straight from the pool. → bytes written."""
        if self.stage is not None and run_count(slots) > run_count(dest.slots):
            return self.stage.write(self.transfer, dest.engine, slots, dest.ptrs, dest.slots)
        src, dst, lens = self.regions.byte_ranges(slots, dest.ptrs, dest.slots)
        self.transfer.write(dest.engine, src, dst, lens)
        return sum(lens)

    def _on_tick(self, now: float) -> None:
        for room in [r for r, x in self._ready.items() if x.deadline < now]:
            del self._ready[room]
            self._done.put(_Outcome(room, False, error=f"no decode server asked for room {room} "
                                    f"within {self.cfg.bootstrap_timeout_s:.0f} s"))
        for room in [r for r, (_, t) in self._dests.items() if t + STALE_DESTINATION_S < now]:
            del self._dests[room]
        for room in [r for r, (_, t) in self._failed.items() if t + STALE_DESTINATION_S < now]:
            del self._failed[room]
