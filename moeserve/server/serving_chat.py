"""/v1/chat/completions: chat template → sub-requests → one response or a chunk stream."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from moeserve.server.protocol import (APIError, AssistantMessage, ChatChoice, ChatCompletionChunk,
                                      ChatCompletionRequest, ChatCompletionResponse, ChatLogprobs,
                                      ChatStreamChoice, DeltaMessage, new_id)
from moeserve.server.serving_common import (ChoiceState, chat_logprobs, check_request,
                                            check_top_logprobs, collect, sampling_params, usage)
from moeserve.server.tokenizer_manager import GenInput, TokenizerManager, expand_n


@dataclass
class ChatJob:
    """A validated chat request, ready to run."""

    req: ChatCompletionRequest
    inputs: list[GenInput]
    id: str
    model: str


def _message_dict(m: Any) -> dict[str, Any]:
    """Flatten content parts to text; the server has no multimodal input."""
    content = m.content
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(f"unsupported content part of type {part.get('type')!r}",
                               param="messages")
            texts.append(part["text"])
        content = "".join(texts)
    out = {"role": m.role, "content": content or ""}
    return out | ({"name": m.name} if m.name else {})


def prepare_chat(manager: TokenizerManager, req: ChatCompletionRequest) -> ChatJob:
    check_request(manager, req)
    top = check_top_logprobs(req.top_logprobs, "top_logprobs")
    if top and not req.logprobs:
        raise APIError("top_logprobs needs logprobs=true", param="top_logprobs")
    ids = manager.apply_chat_template([_message_dict(m) for m in req.messages])
    manager.check_ids(ids, "messages")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
        else req.max_tokens
    max_new = manager.resolve_max_tokens(len(ids), max_tokens, "messages")
    base = GenInput(ids, sampling_params(req, max_new), req.logprobs, top)
    return ChatJob(req, expand_n([base], req.n), new_id("chatcmpl"), req.model or
                   manager.served_model_name)


def _logprobs(manager: TokenizerManager, job: ChatJob, ids: list[int], lps: list[float] | None,
              top: list | None) -> ChatLogprobs | None:
    if not job.req.logprobs:
        return None
    return ChatLogprobs(content=chat_logprobs(manager, ids, lps or [], top or []))


async def chat_response(manager: TokenizerManager, job: ChatJob) -> ChatCompletionResponse:
    states = await collect(manager.generate(job.inputs, stream=False), len(job.inputs))
    choices = [ChatChoice(index=i, message=AssistantMessage(content=s.text),
                          logprobs=_logprobs(manager, job, s.ids, s.logprobs, s.top_logprobs),
                          finish_reason=s.finish_reason, stop_reason=s.matched)
               for i, s in enumerate(states)]
    return ChatCompletionResponse(id=job.id, model=job.model, choices=choices,
                                  usage=usage(states, job.req.n))


async def chat_stream(manager: TokenizerManager, job: ChatJob
                      ) -> AsyncIterator[ChatCompletionChunk]:
    """Role chunk per choice, content deltas, a finish chunk per choice, then optional usage."""
    def chunk(choices: list[ChatStreamChoice], **kw: Any) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=job.id, model=job.model, choices=choices, **kw)

    states = [ChoiceState() for _ in job.inputs]
    yield chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                 for i in range(len(job.inputs))])
    async with aclosing(manager.generate(job.inputs, stream=True)) as outputs:
        async for i, out in outputs:
            states[i].update(out)
            if not out.text_delta and out.finish_reason is None and not job.req.logprobs:
                continue
            delta = DeltaMessage(content=out.text_delta if out.text_delta else None)
            yield chunk([ChatStreamChoice(
                index=i, delta=delta, finish_reason=out.finish_reason,
                stop_reason=out.finish_matched,
                logprobs=_logprobs(manager, job, out.new_ids, out.logprobs, out.top_logprobs))])
    if job.req.include_usage:
        yield chunk([], usage=usage(states, job.req.n))
