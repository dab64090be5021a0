"""The scheduler's side of prefill-decode disaggregation: the RoleHost a PD role works through
(moeserve/disaggregation/role.py), built on the scheduler's cache, table and outputs."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from moeserve.core import FinishReason, Req
from moeserve.disaggregation.factory import make_role
from moeserve.scheduler.outputs import append_token, token_output

if TYPE_CHECKING:
    from moeserve.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)


class SchedulerRoleHost:
    def __init__(self, sched: Scheduler):
        self.sched = sched
        self.memory = sched.runner.memory

    def kv_buffers(self) -> list[torch.Tensor]:
        return self.memory.pool.buffers()

    def room_left(self, num_tokens: int) -> bool:
        """Enough KV for the prompt while every running request can still take a token."""
        return self.sched.cache.available() >= num_tokens + len(self.sched.running)

    def alloc_kv(self, num_tokens: int) -> tuple[int, list[int]] | None:
        rows = self.memory.req_to_token.alloc(1)
        if rows is None:
            return None
        slots = self.sched.cache.alloc_slots(num_tokens, contiguous=True)
        if slots is None:
            self.memory.req_to_token.free(rows)
            return None
        self.sched.timeline.note("kv_reserved", num_tokens)
        return rows[0], slots.tolist()

    def free_kv(self, row: int, slots: list[int]) -> None:
        self.memory.allocator.free(torch.tensor(slots, dtype=torch.int64))
        self.memory.req_to_token.free(row)

    def release(self, req: Req) -> None:
        self.sched.cache.release(req)

    def step_done(self, req: Req) -> Callable[[], tuple[list[int], bytes] | None]:
        """Prefill (loop thread, the request just finished): → a call for the link thread that
        waits until the device work of the request's last step ended (on CUDA the draft extend,
        which writes the MTP layer's KV and state, may still be running) and returns the draft
        state of its row (None: not speculating)."""
        spec, row = self.sched.worker.spec, req.req_pool_idx
        event = None
        if self.sched.runner.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()

        def read() -> tuple[list[int], bytes] | None:
            if event is not None:
                event.synchronize()
            return spec.draft_state(row) if spec is not None else None
        return read

    def activate(self, req: Req, row: int, slots: list[int], first_token: int,
                 first_logprob: float | None, first_top: list[tuple[int, float]] | None,
                 draft: tuple[list[int], bytes] | None = None) -> None:
        """The prompt's KV is in `slots` (the MTP layer's too), `draft` the draft's state after
        the first token: the request continues as if prefilled here."""
        s, n = self.sched, len(req.input_ids)
        s.timeline.note("kv_activated", n)
        table = self.memory.req_to_token
        dev = table.req_to_token.device
        table.req_to_token[row, :n] = torch.tensor(slots, dtype=torch.int64).to(dev)
        table.token_ids[row, :n] = torch.tensor(req.input_ids, dtype=torch.int64).to(dev)
        table.token_ids[row, n] = first_token
        req.req_pool_idx, req.kv_slots, req.kv_len, req.prefix_len = row, list(slots), n, 0
        req.last_node = s.cache.tree.match_prefix([]).last_node  # the root: nothing locked
        req.device_len = n + 1
        s.stats["prompt_tokens"] += n
        spec = s.worker.spec
        if spec is not None:  # without it the first verify drafts from another row's state
            error = ("the prefill sent no draft state (it does not speculate)" if draft is None
                     else spec.set_draft_state(row, *draft))
            if error is not None:
                s.stats["pd_draft_state_missing"] = s.stats.get("pd_draft_state_missing", 0) + 1
                logger.warning("request %s: %s; its first draft is a guess", req.rid, error)
        if req.grammar is not None:
            req.grammar.accept(first_token)
        lp = [first_logprob] if first_logprob is not None else None
        finish = append_token(s.stop, req, first_token, lp, [list(first_top or [])], 0)
        if finish is not None:
            s._finish(req, finish)
        else:
            s.running.append(req)
        s.io.send_outputs([token_output(req, s.cfg.spec.draft_nodes)], s._take_stop_strings([req]))

    def fail(self, req: Req, error: str) -> None:
        self.sched._finish(req, FinishReason("abort"))
        self.sched.pending_stop_strings.pop(req.rid, None)
        self.sched._reject(req, error)


def make_pd(sched: Scheduler):
    """The scheduler's PD role (None when colocated)."""
    return make_role(sched.cfg, SchedulerRoleHost(sched), sched.runner.device.type)


def extend_alloc_hint(pd, added: list[Req]) -> dict:
    """How a prefill batch asks for its slots: a PD prefill server's prompts leave by transfer,
    one byte range per run of slots, so it asks for few runs, continuing the first request's last
    chunk (or cached prefix) where the slots after it are free; colocated: the free list's head."""
    if pd is None or pd.mode != "prefill" or not added:
        return {}
    first = added[0].kv_slots
    return {"contiguous": True, "after": first[-1] + 1 if first else None}
