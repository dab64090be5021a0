"""The tokenizer manager: the main process's asyncio bridge between HTTP handlers and schedulers.

It tokenizes and validates requests, sends `GenerateReq`s, and one background task reads everything
that comes back on `manager_in` (text outputs, control replies, ready handshakes, load reports) and
routes it by type. Each generation call owns one asyncio queue; its sub-requests (n > 1, several
prompts) are routed there with their index, so a handler sees one ordered stream.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import json
import logging
import os
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import zmq
import zmq.asyncio

from moeserve.config import MoeserveConfig
from moeserve.core import SamplingParams
from moeserve.ipc.messages import (AbortReq, Bootstrap, ControlReply, ControlReq, GenerateReq,
                                   LoadReport, ManagerInput, ReadyMsg, RequestsLost, TextOutput,
                                   TextOutputBatch)
from moeserve.ipc.queues import AsyncPullQueue, Endpoints, PushQueue
from moeserve.runtime.grammar import GrammarCompiler
from moeserve.server.metrics import Metrics, RequestTimer
from moeserve.server.chat_messages import TemplateCaps, probe_template, render_first
from moeserve.server.protocol import APIError
from moeserve.server.token_bytes import TokenBytes
from moeserve.server.tool_parsers import ToolParser

logger = logging.getLogger(__name__)

SHUTDOWN_ERROR = "The server is shutting down"  # errors that start so are 503s (guard.py)


@dataclasses.dataclass(frozen=True)
class GenInput:
    """One sub-request: becomes one GenerateReq and one choice of the response."""

    input_ids: list[int]
    sampling: SamplingParams
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1  # prompt logprobs from this position on (-1: none)
    input_top_logprobs_num: int = 0
    bootstrap: Bootstrap | None = None  # PD disaggregation: this sub-request's own room


def expand_n(inputs: list[GenInput], n: int, pd: tuple | None = None) -> list[GenInput]:
    """n samples per input, prompt-major (choice index = prompt * n + j); seeds become seed + j so
    the samples differ yet stay reproducible. `pd` (host, port, room or rooms per prompt): each
    sub-request gets its own room, derived the same way on the prefill and the decode server."""
    out = []
    for i, x in enumerate(inputs):
        for j in range(n):
            seed = None if x.sampling.seed is None else x.sampling.seed + j
            out.append(dataclasses.replace(x, sampling=dataclasses.replace(x.sampling, seed=seed),
                                           bootstrap=_room(pd, i, j, n)))
    return out


def _room(pd: tuple | None, prompt: int, sample: int, n: int) -> Bootstrap | None:
    if pd is None:
        return None
    host, port, room = pd
    base = room[prompt] if isinstance(room, list) else room + prompt * n
    return Bootstrap(host=host, port=port, room=(base + sample) % (1 << 64))


class TokenizerManager:
    def __init__(self, cfg: MoeserveConfig, model_path: str, endpoints: Endpoints,
                 num_ranks: int = 1, metrics: Metrics | None = None):
        """Must be created inside the running event loop (the async socket binds to it)."""
        from transformers import AutoTokenizer

        self.cfg, self.model_path, self.num_ranks = cfg, model_path, num_ranks
        self.served_model_name = cfg.server.served_model_name or os.path.basename(
            os.path.normpath(model_path))
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.vocab_size = _vocab_size(model_path, len(self.tokenizer))
        self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size)  # 400s for bad schemas
        self.token_bytes = TokenBytes(self.tokenizer)  # logprobs' token text and bytes
        self.metrics = metrics or Metrics()
        self._push = PushQueue(zmq.Context.instance(), endpoints.scheduler_in)
        self._pull: AsyncPullQueue = AsyncPullQueue(zmq.asyncio.Context.instance(),
                                                    endpoints.manager_in, ManagerInput, bind=True)
        self.ready: dict[tuple[str, int], dict] = {}
        self.loads: dict[int, LoadReport] = {}
        self._ready_changed = asyncio.Event()
        self._routes: dict[str, tuple[asyncio.Queue, int]] = {}
        self._replies: dict[int, tuple[list[ControlReply], asyncio.Future]] = {}
        self._cid = itertools.count()
        self._reader: asyncio.Task | None = None
        self.ledger: Any = None  # elastic/retry.py's RequestLedger (parallel.elastic_ep)
        self._handlers: dict[type, Callable[[Any], None]] = {
            TextOutputBatch: self._on_text, ControlReply: self._on_reply,
            ReadyMsg: self._on_ready, LoadReport: self.on_load, RequestsLost: self._on_lost}

    # ---- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        self._reader = asyncio.get_running_loop().create_task(self._read_loop())

    @property
    def healthy(self) -> bool:
        return self._reader is not None and not self._reader.done()

    async def wait_ready(self, expected: set[tuple[str, int]], timeout: float,
                         check_alive: Callable[[], None]) -> None:
        """Wait until every (role, rank) in `expected` sent ReadyMsg; `check_alive` raises when a
        child died, which ends the wait at once."""
        deadline = asyncio.get_running_loop().time() + timeout
        while not expected <= self.ready.keys():
            check_alive()
            if asyncio.get_running_loop().time() > deadline:
                missing = sorted(expected - self.ready.keys())
                raise TimeoutError(f"no ready message from {missing} within {timeout:.0f} s")
            self._ready_changed.clear()
            try:
                await asyncio.wait_for(self._ready_changed.wait(), 0.2)
            except asyncio.TimeoutError:
                pass

    @property
    def scheduler_info(self) -> dict:
        return self.ready.get(("scheduler", 0), {})

    @property
    def max_req_len(self) -> int:
        """Longest prompt + completion: the context length, capped by the KV pool's capacity."""
        info = self.scheduler_info
        return int(min(info.get("max_req_len", 1 << 62), info.get("max_total_tokens", 1 << 62)))

    def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        self._push.close()
        self._pull.close()

    # ---- inbound messages -----------------------------------------------------------------------
    async def _read_loop(self) -> None:
        while True:
            msg = await self._pull.get()
            try:
                self._handlers[type(msg)](msg)
            except Exception:  # a bad message must not kill the router of every request
                logger.exception("failed to handle %s", type(msg).__name__)

    def _on_text(self, batch: TextOutputBatch) -> None:
        for out in batch.outputs:
            route = self._routes.get(out.rid)
            if route is None:
                continue  # aborted or unknown: nobody waits for it
            if self.ledger is not None:
                self.ledger.on_output(out)
            if out.finish_reason is not None:
                del self._routes[out.rid]
            route[0].put_nowait((route[1], out))

    def _on_reply(self, reply: ControlReply) -> None:
        entry = self._replies.get(reply.cid)
        if entry is None:
            return
        entry[0].append(reply)
        if len(entry[0]) >= self.num_ranks and not entry[1].done():
            entry[1].set_result(sorted(entry[0], key=lambda r: r.rank))

    def _on_lost(self, msg: RequestsLost) -> None:
        """Elastic EP: a rank died; its requests resume elsewhere or end with the error."""
        if self.ledger is None:
            return
        for rid, error in self.ledger.on_lost(msg, self._routes):
            queue, index = self._routes.pop(rid)
            queue.put_nowait((index, TextOutput(rid=rid, text_delta="", new_ids=[],
                                                finish_reason="abort", error=error)))

    def send(self, msg: GenerateReq) -> None:
        """A request to the schedulers as it is (elastic EP's resumed requests)."""
        self._push.put(msg)

    def set_num_ranks(self, n: int) -> None:
        """Elastic EP: how many ranks answer control requests now; waits already answered by
        that many complete."""
        self.num_ranks = n
        for replies, future in self._replies.values():
            if len(replies) >= n and not future.done():
                future.set_result(sorted(replies, key=lambda r: r.rank))

    def _on_ready(self, msg: ReadyMsg) -> None:
        logger.info("%s %d ready %s", msg.role, msg.rank, msg.info or "")
        self.ready[(msg.role, msg.rank)] = dict(msg.info)
        self._ready_changed.set()

    def on_load(self, report: LoadReport) -> None:
        self.loads[report.rank] = report
        self.metrics.observe_load(report)

    # ---- requests -------------------------------------------------------------------------------
    def tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer(text)["input_ids"])

    @functools.cached_property
    def template_caps(self) -> TemplateCaps:
        """What the chat template renders of tool calls and results (chat_messages.py)."""
        return probe_template(lambda m: self.tokenizer.apply_chat_template(m, tokenize=False))

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            tools: list[dict[str, Any]] | None = None,
                            template_kwargs: dict[str, Any] | None = None,
                            add_generation_prompt: bool = True,
                            parser: ToolParser | None = None) -> list[int]:
        """Ids of a chat prompt ending with the assistant turn's opening (as the Engine does);
        `template_kwargs` (e.g. enable_thinking) are variables the template reads. Messages as
        clients send them (tool calls, tool results) are rendered in the first form the template
        accepts (chat_messages.py); `parser` writes tool calls as text where it cannot."""
        def render(form: list[dict[str, Any]]) -> Any:
            return self.tokenizer.apply_chat_template(
                form, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=True,
                **(template_kwargs or {}))

        try:
            out = render_first(render, messages, self.template_caps, parser)
        except Exception as e:  # jinja errors on unexpected roles/orders
            raise APIError(f"could not apply the chat template: {e}", param="messages") from e
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    def check_ids(self, ids: list[int], param: str) -> None:
        if not ids:
            raise APIError("the prompt is empty", param=param)
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise APIError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})",
                           param=param)

    @property
    def max_completion_tokens(self) -> int:
        """The largest max_tokens accepted: server.max_completion_tokens, at most the context
        minus one (the prompt needs a token)."""
        cap = self.cfg.server.max_completion_tokens
        return self.max_req_len - 1 if cap is None else min(cap, self.max_req_len - 1)

    def resolve_max_tokens(self, prompt_len: int, max_tokens: int | None, param: str,
                           minimum: int = 1) -> int:
        """max_tokens is a cap: generation also ends where the context does (finish_reason
        "length"), so a request whose prompt fits is served with any max_tokens up to
        `max_completion_tokens` (above it: 400; a prompt that fills the context: 400).
        None → the rest of the context, within max_completion_tokens. `minimum`: 0 where
        scoring a prompt alone is allowed."""
        limit = self.max_req_len
        if max_tokens is not None and max_tokens < minimum:
            raise APIError(f"max_tokens must be at least {minimum}, got {max_tokens}",
                           param="max_tokens")
        cap = self.cfg.server.max_completion_tokens
        if cap is not None and (max_tokens or 0) > cap:
            raise APIError(f"max_tokens must be at most {cap} (server.max_completion_tokens), "
                           f"got {max_tokens}", param="max_tokens")
        if prompt_len >= limit or (max_tokens or 0) >= limit:
            asked = prompt_len + (max_tokens or 0)
            raise APIError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{asked} tokens ({prompt_len} in the {param}, {max_tokens or 0} in the "
                f"completion). Please reduce the length of the {param} or completion.",
                param=param if prompt_len >= limit else "max_tokens",
                code="context_length_exceeded")
        room = limit - prompt_len if cap is None else min(limit - prompt_len, cap)
        return room if max_tokens is None else min(max_tokens, room)

    def model_info(self) -> dict[str, Any]:
        """What /model_info answers: SGLang's fields, plus the limits requests are checked
        against."""
        arch = _config_value(self.model_path, "architectures") or []
        return {"model_path": self.model_path, "tokenizer_path": self.model_path,
                "served_model_name": self.served_model_name, "is_generation": True,
                "model_type": _config_value(self.model_path, "model_type"),
                "architectures": arch, "has_image_understanding": False,
                "has_audio_understanding": False, "preferred_sampling_params": None,
                "max_req_len": self.max_req_len, "vocab_size": self.vocab_size}

    def check_n(self, n: int) -> None:
        if not 1 <= n <= self.cfg.server.max_n:
            raise APIError(f"n must be between 1 and {self.cfg.server.max_n}, got {n}", param="n")

    async def generate(self, inputs: list[GenInput], stream: bool = True
                       ) -> AsyncIterator[tuple[int, TextOutput]]:
        """Send every input and yield (index, output) as they arrive until all finished. Leaving
        early (client gone, cancellation, error) aborts the unfinished sub-requests."""
        group, queue = uuid.uuid4().hex, asyncio.Queue()
        rids = [f"{group}-{i}" for i in range(len(inputs))]
        timers = [RequestTimer(self.metrics) for _ in inputs]
        for i, (rid, x) in enumerate(zip(rids, inputs)):
            self._routes[rid] = (queue, i)
            req = GenerateReq(rid=rid, input_ids=x.input_ids, sampling=x.sampling,
                              stream=stream, return_logprob=x.return_logprob,
                              top_logprobs_num=x.top_logprobs_num,
                              logprob_start_len=x.logprob_start_len,
                              input_top_logprobs_num=x.input_top_logprobs_num,
                              bootstrap=x.bootstrap, dp_rank=self._pd_rank(x))
            if self.ledger is not None:
                self.ledger.sent(req)
            self._push.put(req)
        pending = set(range(len(inputs)))
        try:
            while pending:
                i, out = await queue.get()
                timers[i].on_tokens(len(out.new_ids))
                if out.finish_reason is not None:
                    pending.discard(i)
                    timers[i].on_finish(out.finish_reason, out.prompt_tokens, out.cached_tokens,
                                        (out.spec_verify_steps, out.spec_draft_tokens,
                                         out.spec_accepted_tokens))
                yield i, out
        finally:
            self.abort([rids[i] for i in pending])

    def refuse_rooms(self, pd: tuple | None, n: int, error: str) -> None:
        """A PD prefill server refused a request before it reached a rank: the ranks its rooms
        map to tell the decode server now (which would otherwise wait for the KV until its
        timeout). One prompt's rooms, or a list of rooms, each with n samples (expand_n)."""
        if pd is None or self.cfg.disaggregation.mode != "prefill":
            return
        host, port, room = pd
        n = max(1, min(n, self.cfg.server.max_n))
        rooms = [r + j for r in (room if isinstance(room, list) else [room]) for j in range(n)]
        for r in rooms:
            x = GenInput([], SamplingParams(max_new_tokens=1),
                         bootstrap=Bootstrap(host=host, port=port, room=r % (1 << 64)))
            self._push.put(GenerateReq(rid=f"refused-{uuid.uuid4().hex}", input_ids=[],
                                       sampling=x.sampling, bootstrap=x.bootstrap,
                                       dp_rank=self._pd_rank(x), refused=error))

    def _pd_rank(self, x: GenInput) -> int | None:
        """A PD prefill server pins each room to DP rank room % dp_size: the rank the decode
        server's bootstrap query names (disaggregation/bootstrap.py)."""
        if x.bootstrap is None or self.cfg.disaggregation.mode != "prefill":
            return None
        return x.bootstrap.room % self.cfg.parallel.dp_size

    def abort(self, rids: list[str]) -> None:
        """Stop sub-requests nobody waits for any more (the scheduler frees their KV)."""
        for rid in rids:
            if self.ledger is not None:
                self.ledger.forget(rid)
            if self._routes.pop(rid, None) is not None:
                self._push.put(AbortReq(rid=rid))
                self.metrics.aborted.inc()
        if rids:
            logger.info("aborted %d request(s)", len(rids))

    def fail_all(self, message: str) -> int:
        """End every generation in flight with an error (`message`, a 503 when it starts with
        SHUTDOWN_ERROR) and abort its scheduler work; returns how many sub-requests."""
        routes, self._routes = self._routes, {}
        for rid, (queue, index) in routes.items():
            queue.put_nowait((index, TextOutput(rid=rid, text_delta="", new_ids=[],
                                                finish_reason="abort", error=message)))
            self._push.put(AbortReq(rid=rid))
        return len(routes)

    @property
    def num_inflight(self) -> int:
        return len(self._routes)

    async def control(self, op: str, args: dict | None = None,
                      timeout: float = 30.0) -> list[ControlReply]:
        """Send a control request and wait for the reply of every rank."""
        cid = next(self._cid)
        future = asyncio.get_running_loop().create_future()
        self._replies[cid] = ([], future)
        self._push.put(ControlReq(cid=cid, op=op, args=args or {}))
        try:
            return await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError as e:
            raise APIError(f"{op}: no reply from every rank within {timeout:.0f} s",
                           status_code=503, type="server_error") from e
        finally:
            self._replies.pop(cid, None)

    def load_summary(self) -> dict[str, int]:
        keys = ("running", "waiting", "used_tokens", "max_total_tokens")
        return {k: sum(getattr(r, k) for r in self.loads.values()) for k in keys}


def _config_value(model_path: str, key: str) -> Any:
    """A field of the model's config.json (None without one)."""
    try:
        with open(os.path.join(model_path, "config.json")) as f:
            return json.load(f).get(key)
    except (OSError, ValueError):
        return None


def _vocab_size(model_path: str, fallback: int) -> int:
    """The model's vocabulary (ids the embedding accepts), from config.json when present."""
    try:
        return int(_config_value(model_path, "vocab_size") or fallback)
    except (TypeError, ValueError):
        return fallback
