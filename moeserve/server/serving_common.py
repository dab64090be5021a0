"""What the OpenAI routes share: request → SamplingParams, per-choice accumulation, usage, logprob
rendering, SSE framing and running a handler until the client disconnects."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel
from starlette.requests import Request

from moeserve.core import SamplingParams
from moeserve.elastic.retry import RANK_LOST_ERROR
from moeserve.ipc.messages import TextOutput
from moeserve.server.protocol import (MAX_TOP_LOGPROBS, APIError, PromptLogprob, TokenLogprob,
                                      TopLogprob, Usage, _SamplingRequest)
from moeserve.server.request_models import JsonObjectFormat, JsonSchemaResponseFormat
from moeserve.server.tokenizer_manager import SHUTDOWN_ERROR, TokenizerManager

T = TypeVar("T")


class ClientGone(Exception):
    """The HTTP client disconnected before the response was ready."""


# sglang-router's `model` for requests that name none; each worker serves one model, so it means
# this one (SGLang's own server ignores the field)
ROUTER_DEFAULT_MODEL = "unknown"


def model_names(manager: TokenizerManager) -> list[str | None]:
    """What a request's `model` may be: this server's model by name or path, or none."""
    return [manager.served_model_name, manager.model_path, ROUTER_DEFAULT_MODEL, "", None]


def check_request(manager: TokenizerManager, req: _SamplingRequest) -> None:
    """Model name, n and token ids (before any tokenization work)."""
    if req.model not in model_names(manager):
        raise APIError(f"The model `{req.model}` does not exist.", status_code=404,
                       param="model", code="model_not_found")
    manager.check_n(req.n)
    if req.stop_token_ids:
        manager.check_ids(req.stop_token_ids, "stop_token_ids")


def response_model(manager: TokenizerManager, req: _SamplingRequest) -> str:
    """The `model` a response names: the request's, or the served model's when it named none
    (or the router's placeholder)."""
    return req.model if req.model not in (None, "", ROUTER_DEFAULT_MODEL) else \
        manager.served_model_name


def pd_of(req: Any) -> tuple | None:
    """(bootstrap host, port, room or rooms) when SGLang's PD router sent them all."""
    if req.bootstrap_host is None or req.bootstrap_port is None or req.bootstrap_room is None:
        return None
    return req.bootstrap_host, req.bootstrap_port, req.bootstrap_room


def check_top_logprobs(k: int | None, param: str) -> int:
    if k is not None and not 0 <= k <= MAX_TOP_LOGPROBS:
        raise APIError(f"{param} must be between 0 and {MAX_TOP_LOGPROBS}, got {k}", param=param)
    return k or 0


def logit_bias(manager: TokenizerManager, bias: dict[str, float] | None
               ) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id as a string": bias} → (id, bias) pairs, ids checked against the vocab."""
    out = []
    for key, value in (bias or {}).items():
        try:
            tid = int(key)
        except ValueError:
            raise APIError(f"logit_bias keys must be token ids, got {key!r}",
                           param="logit_bias") from None
        if not 0 <= tid < manager.vocab_size:
            raise APIError(f"logit_bias token id {tid} is outside the vocabulary "
                           f"[0, {manager.vocab_size})", param="logit_bias")
        out.append((tid, float(value)))
    return tuple(out)


def grammar_spec(manager: TokenizerManager, req: _SamplingRequest,
                 tool_grammar: tuple[str, str] | None = None) -> tuple[str, str] | None:
    """response_format / regex / ebnf → (kind, source), compiled here once so a bad one is a 400.
    `tool_grammar` (already compiled) is what tool_choice required or named forces; the request
    may not constrain its output a second way."""
    fmt = req.response_format
    specs: list[tuple[str, str, str]] = []  # (param, kind, source)
    if isinstance(fmt, JsonObjectFormat):
        specs.append(("response_format", fmt.type, ""))
    elif isinstance(fmt, JsonSchemaResponseFormat):
        specs.append(("response_format", fmt.type, json.dumps(fmt.json_schema.schema_)))
    specs += [(k, k, v) for k, v in (("regex", req.regex), ("ebnf", req.ebnf)) if v is not None]
    if tool_grammar is not None:
        if specs:
            raise APIError(f"tool_choice required or named constrains the reply to tool calls; "
                           f"{specs[0][0]} cannot constrain it too", param=specs[0][0])
        return tool_grammar
    if len(specs) > 1:
        raise APIError(f"only one of {', '.join(p for p, _, _ in specs)} may constrain the output",
                       param=specs[1][0])
    if not specs:
        return None
    param, kind, source = specs[0]
    try:
        manager.grammars.compile((kind, source))
    except ValueError as e:
        raise APIError(str(e), param=param, code="invalid_grammar") from None
    return kind, source


def sampling_params(manager: TokenizerManager, req: _SamplingRequest, max_new_tokens: int,
                    tool_grammar: tuple[str, str] | None = None) -> SamplingParams:
    """OpenAI defaults: temperature 1, top_p 1; top_k 0 or -1 both mean disabled."""
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    try:
        return SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=-1 if req.top_k in (None, 0) else req.top_k,
            min_p=req.min_p or 0.0, seed=req.seed, stop=tuple(s for s in stop if s),
            stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos,
            frequency_penalty=req.frequency_penalty or 0.0,
            presence_penalty=req.presence_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            logit_bias=logit_bias(manager, req.logit_bias),
            grammar=grammar_spec(manager, req, tool_grammar))
    except ValueError as e:
        param = str(e).split(" ", 1)[0]
        raise APIError(str(e), param=param if param in type(req).model_fields else None) from e


@dataclass
class ChoiceState:
    """Everything received so far for one choice."""

    text: str = ""
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    matched: int | str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    spec: tuple[int, int, int] = (0, 0, 0)  # verify steps, draft tokens, accepted tokens
    input_logprobs: list[float | None] | None = None  # prompt logprobs, when asked for
    input_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    input_ranks: list[int | None] | None = None

    def update(self, out: TextOutput) -> None:
        if out.error:
            unavailable = out.error.startswith((SHUTDOWN_ERROR, RANK_LOST_ERROR))
            raise APIError(out.error, status_code=503 if unavailable else 400,
                           type="server_error" if unavailable else "invalid_request_error")
        self.text += out.text_delta
        self.ids += out.new_ids
        self.logprobs += out.logprobs or []
        self.top_logprobs += out.top_logprobs or []
        self.finish_reason, self.matched = out.finish_reason, out.finish_matched
        self.prompt_tokens = out.prompt_tokens or self.prompt_tokens
        self.completion_tokens = max(out.completion_tokens, len(self.ids))
        self.cached_tokens = out.cached_tokens or self.cached_tokens
        if out.spec_verify_steps:
            self.spec = (out.spec_verify_steps, out.spec_draft_tokens, out.spec_accepted_tokens)
        if out.input_logprobs is not None:
            self.input_logprobs, self.input_ranks = out.input_logprobs, out.input_ranks
            self.input_top_logprobs = out.input_top_logprobs


async def collect(stream: AsyncIterator[tuple[int, TextOutput]], num: int) -> list[ChoiceState]:
    states = [ChoiceState() for _ in range(num)]
    async with aclosing(stream):  # NOTE: an error here must abort the other sub-requests now
        async for i, out in stream:
            states[i].update(out)
    return states


def usage(states: list[ChoiceState], n: int) -> Usage:
    """Prompt tokens once per prompt (not per sample), completion tokens of every choice."""
    prompts = [states[i : i + n] for i in range(0, len(states), n)]
    spec = [sum(s.spec[k] for s in states) for k in range(3)]
    return Usage.of(sum(g[0].prompt_tokens for g in prompts),
                    sum(s.completion_tokens for s in states),
                    sum(max(s.cached_tokens for s in g) for g in prompts),
                    spec if spec[0] else None)


def token_text(manager: TokenizerManager, token_id: int) -> str:
    """The token's own bytes as text (server/token_bytes.py): partial UTF-8 as \\xHH escapes."""
    return manager.token_bytes.text_of(token_id)


def chat_logprobs(manager: TokenizerManager, ids: list[int], logprobs: list[float],
                  top: list[list[tuple[int, float]]]) -> list[TokenLogprob]:
    def entry(cls: type, tid: int, lp: float, **kw: Any) -> Any:
        return cls(token=token_text(manager, tid), logprob=lp,
                   bytes=list(manager.token_bytes.bytes_of(tid)), **kw)

    def tops(k: int) -> list[TopLogprob]:
        return [entry(TopLogprob, t, v) for t, v in (top[k] if k < len(top) else [])]

    return [entry(TokenLogprob, tid, lp, top_logprobs=tops(k))
            for k, (tid, lp) in enumerate(zip(ids, logprobs))]


def vllm_prompt_logprobs(manager: TokenizerManager, ids: list[int], s: ChoiceState, top: int
                         ) -> list[dict[str, PromptLogprob] | None]:
    """vLLM's `prompt_logprobs`: per prompt position None (position 0) or {token id: {logprob,
    rank, decoded_token}} holding the prompt's token and the `top` most likely ones."""
    out: list[dict[str, PromptLogprob] | None] = []
    for j, lp in enumerate(s.input_logprobs or []):
        if lp is None:
            out.append(None)
            continue
        alts = (s.input_top_logprobs or [])[j] if s.input_top_logprobs else []
        entry = {str(t): PromptLogprob(logprob=v, rank=r + 1, decoded_token=token_text(manager, t))
                 for r, (t, v) in enumerate((alts or [])[:top])}
        rank = (s.input_ranks or [None] * (j + 1))[j]
        entry[str(ids[j])] = PromptLogprob(logprob=lp, rank=rank,
                                           decoded_token=token_text(manager, ids[j]))
        out.append(entry)
    return out


def sse(event: BaseModel | dict) -> str:
    body = event.model_dump_json(exclude_none=True) if isinstance(event, BaseModel) else json.dumps(
        event)
    return f"data: {body}\n\n"


SSE_DONE = "data: [DONE]\n\n"


async def sse_stream(events: AsyncIterator[BaseModel]) -> AsyncIterator[str]:
    """Frame events as SSE; an error after the headers went out becomes an error event."""
    try:
        async for event in events:
            yield sse(event)
    except APIError as e:
        yield sse(e.body())
    yield SSE_DONE


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Run `work` but cancel it (aborting its requests) if the client goes away first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task in done:
        return task.result()
    raise ClientGone()


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass

