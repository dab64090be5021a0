"""The offline Engine's multi-rank core: the DP controller and one scheduler process per rank,
driven over ZMQ from the caller's process.

One process cannot host several ranks (each joins torch.distributed), so with tp_size > 1 the
Engine starts the same children as the server (without detokenizer and HTTP) and takes both ends
itself: it binds `detokenizer_in` to collect the ranks' TokenOutputBatch (text is decoded once at
the end) and `manager_in` for ReadyMsg, ControlReply and LoadReport; requests go to `scheduler_in`,
which the controller binds. The children are stopped by `shutdown()`, when the core is collected,
or at interpreter exit (before multiprocessing would join them forever).
"""

from __future__ import annotations

import atexit
import itertools
import logging
import time
from collections.abc import Callable
from typing import Any

import zmq

from moeserve.config import MoeserveConfig
from moeserve.ipc.messages import (AbortReq, ControlReply, ControlReq, DetokenizerInput,
                                   GenerateReq, LoadReport, ManagerInput, ReadyMsg,
                                   TextOutputBatch, TokenOutput, TokenOutputBatch)
from moeserve.ipc.queues import Endpoints, PullQueue, PushQueue
from moeserve.procs.children import ProcessGroup

logger = logging.getLogger(__name__)

POLL_MS = 100


class _Children:
    """What must be released even if the core is never shut down explicitly (no reference back
    to the core, so that an unused Engine can still be collected)."""

    def __init__(self, log_level: str, endpoints: Endpoints, start_method: str):
        import multiprocessing.util  # noqa: F401  (its atexit join must run after ours)

        self.procs = ProcessGroup(log_level, start_method=start_method)
        self.ctx = zmq.Context()
        self.endpoints = endpoints
        self.queues: list[Any] = []  # held here: a collected core must not drop open sockets
        self.closed = False
        atexit.register(self.close)

    def add(self, queue: Any) -> Any:
        self.queues.append(queue)
        return queue

    def close(self) -> None:
        if self.closed:
            return
        from moeserve.procs.ipc_files import remove_ipc_files

        self.closed = True
        atexit.unregister(self.close)
        self.procs.stop()
        for q in self.queues:
            q.close()
        self.ctx.term()
        remove_ipc_files(self.endpoints)


class MultiRankCore:
    """Runs GenerateReqs on tp_size scheduler processes; `run` blocks until all finished."""

    def __init__(self, cfg: MoeserveConfig, model_path: str, tokenizer: Any):
        from moeserve.dp_attention.controller import run_controller_process
        from moeserve.procs.ranks import start_ranks
        from moeserve.procs.rendezvous import with_rendezvous
        from moeserve.scheduler.process import run_scheduler_process

        if cfg.parallel.elastic_ep:
            from moeserve.config import ConfigError

            raise ConfigError("parallel.elastic_ep", "the offline Engine does not survive a "
                              "rank's loss; serve with `python -m launch.server`")
        self.config = cfg = with_rendezvous(cfg)
        self.tokenizer = tokenizer
        endpoints = Endpoints.fresh(cfg.parallel.dp_size)
        self._children = _Children(cfg.server.log_level, endpoints, cfg.server.start_method)
        ctx, add = self._children.ctx, self._children.add
        self._outputs: PullQueue = add(PullQueue(ctx, endpoints.detokenizer_in, DetokenizerInput))
        self._inbox: PullQueue = add(PullQueue(ctx, endpoints.manager_in, ManagerInput))
        self._requests = add(PushQueue(ctx, endpoints.scheduler_in))
        self._poller = zmq.Poller()
        for q in (self._outputs, self._inbox):
            self._poller.register(q.socket, zmq.POLLIN)
        self.ready: dict[tuple[str, int], dict] = {}
        self._results: dict[str, list[TokenOutput]] = {}
        self._replies: dict[int, list[ControlReply]] = {}
        self._cid = itertools.count()
        self._handlers: dict[type, Callable[[Any], None]] = {
            TokenOutputBatch: self._on_tokens, ControlReply: self._on_reply,
            ReadyMsg: self._on_ready, LoadReport: lambda msg: None,
            TextOutputBatch: lambda msg: None}
        try:
            expected = start_ranks(self._children.procs, cfg, model_path, endpoints,
                                   run_scheduler_process, run_controller_process)
            self._wait(lambda: expected <= self.ready.keys(), cfg.server.startup_timeout_s,
                       f"ready messages from {sorted(expected)}")
        except BaseException:
            self.shutdown()
            raise

    # ---- inbound ----------------------------------------------------------------------------
    def _on_tokens(self, batch: TokenOutputBatch) -> None:
        for out in batch.outputs:
            if out.rid in self._results:
                self._results[out.rid].append(out)

    def _on_reply(self, reply: ControlReply) -> None:
        if reply.cid in self._replies:
            self._replies[reply.cid].append(reply)

    def _on_ready(self, msg: ReadyMsg) -> None:
        logger.info("%s %d ready %s", msg.role, msg.rank, msg.info or "")
        self.ready[(msg.role, msg.rank)] = dict(msg.info)

    def _pump(self, timeout_ms: int) -> None:
        if not self._poller.poll(timeout_ms):
            return
        for q in (self._outputs, self._inbox):
            for msg in q.get_nowait_all():
                self._handlers[type(msg)](msg)

    def _wait(self, done: Callable[[], bool], timeout: float | None, what: str) -> None:
        """Pump messages until `done()`; a dead child or the timeout raises (and stops all)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not done():
            try:
                self._children.procs.check_alive()
            except Exception:
                self.shutdown()
                raise
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"no {what} within {timeout:.0f} s")
            self._pump(POLL_MS)

    # ---- requests ---------------------------------------------------------------------------
    def run(self, reqs: list[GenerateReq]) -> dict[str, list[TokenOutput]]:
        """Send every request, wait until each finished; → rid → its TokenOutputs in order."""
        self._check_open()
        for req in reqs:
            self._results[req.rid] = []
            self._requests.put(req)

        def finished(rid: str) -> bool:
            outs = self._results[rid]
            return bool(outs) and outs[-1].finish_reason is not None

        try:
            self._wait(lambda: all(finished(r.rid) for r in reqs), None, "results")
        except BaseException:  # e.g. KeyboardInterrupt: the ranks drop what nobody awaits
            if not self._children.closed:
                for r in reqs:
                    if not finished(r.rid):
                        self._requests.put(AbortReq(rid=r.rid))
            raise
        finally:
            results = {r.rid: self._results.pop(r.rid) for r in reqs}
        return results

    def control(self, op: str, args: dict | None = None,
                timeout: float = 60.0) -> list[ControlReply]:
        """A control request to every rank; → one reply per rank, by rank."""
        self._check_open()
        cid = next(self._cid)
        self._replies[cid] = []
        self._requests.put(ControlReq(cid=cid, op=op, args=args or {}))
        world = self.config.parallel.world_size
        try:
            self._wait(lambda: len(self._replies[cid]) >= world, timeout, f"{op} replies")
            return sorted(self._replies[cid], key=lambda r: r.rank)
        finally:
            self._replies.pop(cid, None)

    def _check_open(self) -> None:
        if self._children.closed:
            raise RuntimeError("the engine was shut down")

    def shutdown(self) -> None:
        self._children.close()

    def __del__(self) -> None:
        children = getattr(self, "_children", None)
        if children is not None:
            children.close()
