"""Scheduler: continuous batching for one rank — admit, batch, run, post-process.

The loops that drive it are in loops.py (plain, and overlap: launch step N, then process step
N-1's result while N runs). I/O is abstracted (`SchedulerIO`) so the offline Engine runs the same code in-process.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

from moeserve.config import MoeserveConfig
from moeserve.core import FinishReason, ForwardMode, PromptLogprobs, Req
from moeserve.distributed import ParallelMesh, single_rank_mesh
from moeserve.dp_attention.sync import GlobalBatchInfo, dp_sync
from moeserve.dp_attention.watchdog import LockstepWatchdog, RankState, SyncJitter
from moeserve.env import env
from moeserve.ipc.messages import AbortReq, ControlReq, GenerateReq, Regroup, TokenOutput, Wake
from moeserve.runtime.grammar import GrammarCompiler
from moeserve.runtime.model_runner import ModelRunner
from moeserve.runtime.sampler import make_generator
from moeserve.scheduler.batch import ScheduledBatch
from moeserve.scheduler.cache import CacheManager
from moeserve.scheduler.decode import NewTokenRatio, decodable, pick_retractions
from moeserve.scheduler.grammar_intake import PARKED, GrammarIntake
from moeserve.scheduler.loops import event_loop_normal, event_loop_overlap
from moeserve.scheduler.ops import SchedulerOps
from moeserve.scheduler.outputs import append_token, token_output
from moeserve.scheduler.pd import extend_alloc_hint, make_pd
from moeserve.scheduler.prefill import AddResult, PrefillAdder, prefill_may_wait
from moeserve.scheduler.spec_steps import SpecPolicy
from moeserve.scheduler.stats import StepLog
from moeserve.scheduler.stop import StopChecker
from moeserve.scheduler.timeline import StepTimeline
from moeserve.scheduler.worker import ForwardWorker
from moeserve.tbo.strategy import vote as tbo_vote

logger = logging.getLogger(__name__)


class SchedulerIO(Protocol):
    def recv(self, timeout_ms: int) -> list[GenerateReq | AbortReq | ControlReq | Wake]: ...

    def send_outputs(self, outputs: list[TokenOutput], stop_strings: dict[str, list[str]]) -> None: ...

    def send_control(self, req: ControlReq, ok: bool, data: dict) -> None: ...


class Scheduler:
    def __init__(self, cfg: MoeserveConfig, runner: ModelRunner, io: SchedulerIO,
                 eos_token_ids: set[int], decode_text: Callable[[list[int]], str],
                 mesh: ParallelMesh | None = None, grammars: GrammarCompiler | None = None):
        self.cfg, self.runner, self.io = cfg, runner, io
        self.mesh = mesh or single_rank_mesh(runner.device)
        self._global_idle = True  # from the last DP sync: no rank had work
        self.syncs = 0  # DP syncs entered (the same count on every rank)
        self.watchdog = LockstepWatchdog(self.mesh.rank, cfg.parallel.lockstep_timeout_s)
        self.jitter = SyncJitter.from_env(self.mesh.rank)  # tests: other rank interleavings
        self.ops = SchedulerOps(self)  # control requests and lockstep (EPLB) operations
        sc = cfg.scheduler
        self.cache = CacheManager(runner.memory, cfg.cache.page_size, sc.disable_radix_cache)
        self.overlap = sc.use_overlap(runner.device.type)
        self.mixed_chunk = sc.use_mixed_chunk(runner.device.type)
        self.worker = ForwardWorker(runner, threaded=self.overlap)
        # speculative decoding (the runner built a draft): verify steps and accepted blocks
        self.spec = SpecPolicy(cfg.spec, runner.device.type) if runner.draft is not None else None
        self.stop = StopChecker(eos_token_ids, decode_text)
        self.grammars = GrammarIntake(grammars, eos_token_ids)  # compiles off the loop
        self.ratio = NewTokenRatio(sc.init_new_token_ratio, sc.min_new_token_ratio,
                                   sc.new_token_ratio_decay)
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked: Req | None = None
        self.reqs: dict[str, Req] = {}
        self.pending_stop_strings: dict[str, list[str]] = {}
        self.stats = {"prompt_tokens": 0, "cache_hit_tokens": 0, "retractions": 0,
                      "mixed_steps": 0}
        self.max_req_len = runner.context_len
        self.step_log = StepLog(self.mesh.rank, sc.log_interval_s)
        self.timeline = StepTimeline.from_env(self.mesh.rank, env().step_timeline)
        self.decodes_since_prefill = 0  # decode steps since the last prefill (prefill_wait_steps)
        self.pd = make_pd(self)  # PD disaggregation's role (None: colocated)
        self.elastic = None  # elastic/rank.py's ElasticRank when parallel.elastic_ep is on

    # ---- intake -----------------------------------------------------------------------------
    def handle(self, msg: GenerateReq | AbortReq | ControlReq | Wake) -> None:
        if isinstance(msg, GenerateReq):
            self.timeline.note("in_tokens", len(msg.input_ids))
            self.add_request(msg)
        elif isinstance(msg, AbortReq):
            self.abort(msg.rid)
        elif isinstance(msg, ControlReq):
            self.control(msg)
        elif isinstance(msg, Regroup) and self.elastic is not None:
            self.elastic.on_regroup(msg.generation)
        # Wake: receiving it was the point

    def add_request(self, msg: GenerateReq) -> None:
        req = Req(msg.rid, list(msg.input_ids), msg.sampling, stream=msg.stream,
                  return_logprob=msg.return_logprob, top_logprobs_num=msg.top_logprobs_num)
        if 0 <= msg.logprob_start_len <= len(req.input_ids):  # == len: no prompt entries
            req.prompt_logprobs = PromptLogprobs(msg.logprob_start_len, len(req.input_ids),
                                                 msg.input_top_logprobs_num)
        if msg.resume_ids:  # elastic EP: the stream so far came from a rank that died
            req.output_ids, req.sent_len = list(msg.resume_ids), len(msg.resume_ids)
            req.logprobs, req.top_logprobs = [0.0] * req.sent_len, [[]] * req.sent_len
        req.device_len = len(req.fill_ids)
        req.generator = make_generator(msg.sampling, self.runner.device)
        total = len(req.input_ids) + msg.sampling.max_new_tokens
        state = msg.refused or (None if req.input_ids and total <= self.max_req_len else (
            f"prompt ({len(req.input_ids)} tokens) + max_new_tokens "
            f"({msg.sampling.max_new_tokens}) exceeds the context length {self.max_req_len}"))
        if msg.logprob_start_len > len(req.input_ids):
            state = state or f"logprob_start_len {msg.logprob_start_len} is not a prompt position"
        state = state or self.grammars.attach(req)  # a new grammar: parked while it compiles
        if state not in (None, PARKED):
            if self.pd is not None:  # PD: the peer learns at once, not by a timeout
                self.pd.on_reject(req, msg.bootstrap, state)
            self._reject(req, state)
            return
        self.reqs[req.rid] = req
        if msg.sampling.stop:
            self.pending_stop_strings[req.rid] = list(msg.sampling.stop)
        if self.pd is not None and self.pd.on_request(req, msg.bootstrap):
            return  # a decode server: the role waits for the KV (disaggregation/decode.py)
        if state is None:
            self.waiting.append(req)

    def _reject(self, req: Req, error: str) -> None:
        self.io.send_outputs([TokenOutput(rid=req.rid, new_ids=[], finish_reason="abort",
                                          prompt_tokens=len(req.input_ids), error=error)], {})

    def _take_compiled(self, wait_s: float) -> None:
        """Parked requests whose grammar compiled join the queue (a failed compile rejects)."""
        for req, error in self.grammars.ready(wait_s):
            if error is None:
                if self.pd is None or not self.pd.owns(req):
                    self.waiting.append(req)
            else:
                self.reqs.pop(req.rid, None)
                self.pending_stop_strings.pop(req.rid, None)
                if self.pd is not None:
                    self.pd.on_reject(req, None, error)
                self._reject(req, error)

    def abort(self, rid: str) -> None:
        req = self.reqs.get(rid)
        if req is None or req.finished:
            return
        state = ("retracted" if req in self.waiting and req.retractions else "waiting"
                 if req in self.waiting else "running" if req in self.running else "other")
        self.stats[f"aborted_{state}"] = self.stats.get(f"aborted_{state}", 0) + 1
        self._finish(req, FinishReason("abort"))
        self.io.send_outputs([token_output(req, self.cfg.spec.draft_nodes)],
                             self._take_stop_strings([req]))

    def control(self, msg: ControlReq) -> None:
        self.ops.handle(msg)

    def load(self) -> dict:
        return {"running": len(self.running) + (self.chunked is not None),
                "waiting": len(self.waiting) + len(self.grammars.parked),
                "used_tokens": self.cache.used_tokens(),
                "max_total_tokens": self.runner.memory.allocator.size, **self.stats,
                **(self.spec.totals() if self.spec is not None else {}),
                **({"disagg": self.pd.stats()} if self.pd else {})}

    # ---- scheduling -------------------------------------------------------------------------
    def get_next_batch(self) -> ScheduledBatch | None:
        batch = self._prefill_batch() or self._decode_batch()
        if batch is not None and self.step_log.enabled:
            self.step_log.on_batch(batch.mode, len(batch.reqs),
                                   len(batch.forward_input.new_token_ids or ()))
        return batch

    def _prefill_batch(self) -> ScheduledBatch | None:
        if not self.waiting and self.chunked is None:
            return None
        decoding = decodable(self.running, self.max_req_len)  # once: both policies read it
        if self.chunked is None and self._prefill_may_wait(bool(decoding)):
            return None
        riders = self._riders(decoding)
        adder = PrefillAdder(self.cache.available() - len(riders),
                             max(self.cfg.scheduler.chunked_prefill_size - len(riders), 1),
                             self.ratio.value, self.running, self.cfg.cache.page_size)
        continuing, self.chunked = self.chunked, None
        if continuing is not None and adder.add_chunk_continuation(continuing) == AddResult.NO_ROOM:
            self.chunked = continuing  # wait for decodes to free memory
            return None
        free_rows = self.runner.memory.req_to_token.available_size()
        max_running = self.cfg.cache.max_running_requests - len(self.running) - len(adder.added)
        for req in self._ordered_waiting():
            if adder.chunked is not None or min(free_rows, max_running) <= 0:
                break
            (row,) = self.runner.memory.req_to_token.alloc(1)
            locked = self.cache.admit(req, row)
            result = adder.add(req, req.kv_len, locked)
            if result == AddResult.NO_ROOM:
                self.cache.release(req)
                break
            self._on_admitted(req)
            free_rows, max_running = free_rows - 1, max_running - 1
        if not adder.added:
            return None
        return self._build_extend(adder, riders)

    def _prefill_may_wait(self, decoding: bool) -> bool:
        sc = self.cfg.scheduler
        return prefill_may_wait(self.waiting, decoding, self.decodes_since_prefill,
                                sc.prefill_wait_steps, sc.chunked_prefill_size)

    def _riders(self, decoding: list[Req]) -> list[Req]:
        """Running decodes that ride along with the next prefill step (scheduler.mixed_chunk):
        decoding then goes on while requests prefill. Not while speculating (verify steps have
        their own shape), nor when their slots would not fit."""
        if not self.mixed_chunk or self.spec is not None:
            return []
        return decoding if len(decoding) < self.cache.available() else []

    def _ordered_waiting(self) -> list[Req]:
        if self.cfg.scheduler.policy == "lpm" and len(self.waiting) <= 128:
            prefix = {id(r): self.cache.match_prefix_len(r) for r in self.waiting}
            return sorted(self.waiting, key=lambda r: -prefix[id(r)])
        return list(self.waiting)

    def _on_admitted(self, req: Req) -> None:
        self.waiting.remove(req)
        if req.retractions == 0:
            req.cached_tokens = req.kv_len
            self.stats["prompt_tokens"] += len(req.input_ids)
            self.stats["cache_hit_tokens"] += req.kv_len

    def _build_extend(self, adder: PrefillAdder, riders: list[Req]) -> ScheduledBatch | None:
        slots = self.cache.alloc_slots(sum(adder.extend_lens) + len(riders),
                                       **extend_alloc_hint(self.pd, adder.added))
        if slots is None:  # the budget said yes but eviction fell short: undo and wait
            # NOTE: unreachable while PrefillAdder charges every lock it takes (prefill.py); if it
            # happens, the same batch is rebuilt each step and nothing runs, so say so loudly
            logger.error("admission budget exceeded what eviction could free: %d new tokens, "
                         "%d free, %d evictable; undoing the batch", sum(adder.extend_lens),
                         self.runner.memory.allocator.available_size(),
                         self.cache.tree.evictable_size())
            for req in adder.added:
                self.cache.release(req)
                req.device_len = len(req.fill_ids)
            self.waiting[:0] = [r for r in adder.added]
            return None
        partial = [r is adder.chunked for r in adder.added]
        mode = ForwardMode.MIXED if riders else ForwardMode.EXTEND
        if riders:
            self.ratio.step()
            self.stats["mixed_steps"] += 1
        batch = ScheduledBatch.build(mode, adder.added + riders,
                                     adder.extend_lens + [1] * len(riders), slots,
                                     partial + [False] * len(riders), riders=len(riders))
        self.chunked = adder.chunked
        self.running.extend(r for r, p in zip(adder.added, partial) if not p)
        self.decodes_since_prefill = 0
        return batch

    def _decode_batch(self) -> ScheduledBatch | None:
        reqs = decodable(self.running, self.max_req_len)
        if not reqs:
            return None
        width = self.spec.width(reqs) if self.spec is not None else 1
        if self.cache.available() < width * len(reqs):
            victims = pick_retractions(reqs, self.cache.available(), width)
            for v in victims:
                self._retract(v)
            reqs = [r for r in reqs if r not in victims]
            if not reqs:
                return None
        slots = self.cache.alloc_slots(width * len(reqs))
        self.ratio.step()
        self.decodes_since_prefill += 1
        mode = ForwardMode.DECODE if width == 1 else ForwardMode.TARGET_VERIFY
        return ScheduledBatch.build(mode, reqs, [width] * len(reqs), slots, [False] * len(reqs))

    def _retract(self, req: Req) -> None:
        """Give a running request's KV back and queue it again (its output so far is kept)."""
        self.running.remove(req)
        self.cache.release(req)
        req.epoch += 1
        req.retractions += 1
        req.device_len = len(req.fill_ids)
        self.waiting.insert(0, req)
        self.stats["retractions"] += 1
        self.ratio.on_retract()
        logger.info("retracted %s (%d tokens out)", req.rid, len(req.output_ids))

    # ---- results ----------------------------------------------------------------------------
    def process_result(self, batch: ScheduledBatch, out) -> None:
        """`out` is the finished step's ForwardOutput; no step older than the next is in flight."""
        self.cache.free_deferred_rows()
        batch.record_prompt_scores(out.prompt_scores)
        touched: list[Req] = []
        for i, req in enumerate(batch.reqs):
            if req.finished or req.epoch != batch.epochs[i]:
                continue  # finished, aborted or retracted since this step was scheduled
            if batch.partial[i]:
                self.cache.cache_unfinished(req, batch.kv_ends[i])
                continue
            if req.sampling.max_new_tokens == 0:  # prompt scoring only: nothing is generated
                finish = FinishReason("length")
            elif out.spec_tokens is None:
                finish = append_token(self.stop, req, out.next_token_ids[i], out.logprobs,
                                      out.top_logprobs, i)
            else:  # a verified block: tokens up to the first stop condition
                block, finish = out.spec_tokens[i], None
                for k, token in enumerate(block):
                    finish = append_token(self.stop, req, token,
                                          out.spec_logprobs and out.spec_logprobs[i],
                                          out.spec_top_logprobs and out.spec_top_logprobs[i], k)
                    if finish is not None:
                        break
                self.spec.count(req, k + 1)  # the tokens kept: a stop may cut the block
                self.spec.settle(req, batch.kv_ends[i], k + 1, self.runner.memory.allocator,
                                 out.spec_paths[i] if out.spec_paths else None)
            if finish is not None:
                self._finish(req, finish)
            touched.append(req)
        outputs = [token_output(r, self.cfg.spec.draft_nodes) for r in touched]
        if self.step_log.enabled:
            self.step_log.on_generated(sum(len(o.new_ids) for o in outputs))
            self.step_log.maybe_log(len(self.running), len(self.waiting),
                                    self.cache.used_tokens(), self.runner.memory.allocator.size)
        if outputs:
            self.io.send_outputs(outputs, self._take_stop_strings(touched))

    def _finish(self, req: Req, finish: FinishReason) -> None:
        req.finish = finish
        req.epoch += 1
        if req in self.running:
            self.running.remove(req)
        if req is self.chunked:
            self.chunked = None
        if req in self.waiting:
            self.waiting.remove(req)
        held = self.pd is not None and self.pd.on_finish(req)  # PD prefill: until sent
        if req.req_pool_idx is not None and not held:
            self.cache.release(req)
        self.reqs.pop(req.rid, None)

    def _take_stop_strings(self, reqs: list[Req]) -> dict[str, list[str]]:
        return {r.rid: self.pending_stop_strings.pop(r.rid) for r in reqs
                if r.rid in self.pending_stop_strings}

    # ---- loops ------------------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked)

    def _recv(self, may_block: bool) -> None:
        idle = may_block and self._global_idle and not self.has_work()
        wait_ms = 50 if idle and not self.grammars.parked else 0
        if self.pd is not None:
            self.pd.poll()
            wait_ms = min(wait_ms, 2) if self.pd.busy() else wait_ms  # KV may land any moment
            self.timeline.lap("pd_poll")
        msgs = self.io.recv(wait_ms)
        self.timeline.lap("recv")
        for msg in msgs:
            self.handle(msg)
        self.timeline.lap("handle")
        if self.grammars.parked:  # idle: nothing to run until a compile ends
            self._take_compiled(wait_s=0.005 if idle else 0.0)

    def next_synced_batch(self, stop: bool) -> tuple[ScheduledBatch | None, GlobalBatchInfo]:
        """This rank's next batch after the DP sync: IDLE when only other ranks have work, None
        when no rank has (then no rank runs a forward). Called exactly once per loop iteration on
        every rank (the lockstep invariant: dp_attention/sync.py)."""
        batch = self.get_next_batch()
        n, mode = (batch.num_tokens, batch.mode) if batch else (0, None)
        ops, load = self.ops.pending(), (self.syncs, len(self.waiting), len(self.running))
        self.syncs += 1
        if self.jitter is not None:
            self.jitter.sleep()
        self.watchdog.entering_sync(RankState(self.mesh.rank, load[0], mode.name if mode else
                                              "none", n, load[1], load[2], ops))
        info = dp_sync(self.mesh, n, mode, stop, ops,
                       tbo_vote(self.cfg.tbo, self.runner.tbo_active, mode, n), load)
        self.watchdog.left_sync(info.rank_states(), self.has_work(),
                                batch is not None)
        if self.elastic is not None:
            self.elastic.after_sync(info)
        self._global_idle = not info.any_work
        self.ops.synced_steps += info.any_work
        if batch is None and info.any_work:
            batch = ScheduledBatch.idle()
        if batch is not None:
            batch.forward_input.global_mode = info.global_mode
            batch.forward_input.global_num_tokens = info.num_tokens
            batch.forward_input.global_modes = info.modes
            batch.forward_input.tbo = info.tbo_split
        return batch, info

    def run_forever(self, should_stop: Callable[[], bool] = lambda: False) -> None:
        loop = event_loop_overlap if self.overlap else event_loop_normal
        loop(self, should_stop)
        self.cache.free_deferred_rows()  # loops return with nothing in flight

    def is_memory_clean(self) -> bool:
        """With no requests left, every slot is free or owned (unlocked) by the prefix cache."""
        mem, tree = self.runner.memory, self.cache.tree
        return (not self.has_work() and tree.protected_size() == 0
                and mem.allocator.available_size() + tree.total_size() == mem.allocator.size
                and mem.req_to_token.available_size() == mem.req_to_token.size)
