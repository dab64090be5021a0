"""/v1/completions: prompts (text or ids, one or many) → sub-requests → response or chunk stream."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from moeserve.server.protocol import (APIError, CompletionChoice, CompletionChunk,
                                      CompletionLogprobs, CompletionRequest, CompletionResponse,
                                      new_id)
from moeserve.server.serving_common import (ChoiceState, check_request, check_top_logprobs,
                                            collect, sampling_params, token_text, usage)
from moeserve.server.tokenizer_manager import GenInput, TokenizerManager, expand_n


@dataclass
class CompletionJob:
    req: CompletionRequest
    inputs: list[GenInput]
    echo_texts: list[str]  # per choice: the prompt text when echo, else ""
    id: str
    model: str


def _prompt_ids(manager: TokenizerManager, prompt: str | list) -> list[list[int]]:
    """Normalise the four accepted prompt shapes to a list of token-id lists."""
    if isinstance(prompt, str):
        return [manager.tokenize(prompt)]
    if not prompt:
        raise APIError("the prompt is empty", param="prompt")
    if isinstance(prompt[0], int):
        return [list(prompt)]
    if isinstance(prompt[0], str):
        return [manager.tokenize(p) for p in prompt]
    return [list(p) for p in prompt]


def prepare_completion(manager: TokenizerManager, req: CompletionRequest) -> CompletionJob:
    check_request(manager, req)
    top = check_top_logprobs(req.logprobs, "logprobs")
    if req.echo and req.logprobs is not None:
        raise APIError("echo with logprobs is not supported (no prompt logprobs)", param="echo")
    inputs: list[GenInput] = []
    for ids in _prompt_ids(manager, req.prompt):
        manager.check_ids(ids, "prompt")
        max_new = manager.resolve_max_tokens(len(ids), req.max_tokens, "prompt")
        sampling = sampling_params(manager, req, max_new)
        inputs.append(GenInput(ids, sampling, req.logprobs is not None, top))
    echo = [manager.tokenizer.decode(x.input_ids, skip_special_tokens=True) if req.echo else ""
            for x in inputs for _ in range(req.n)]
    return CompletionJob(req, expand_n(inputs, req.n), echo, new_id("cmpl"),
                         req.model or manager.served_model_name)


def _logprobs(manager: TokenizerManager, job: CompletionJob, ids: list[int],
              lps: list[float] | None, top: list | None, offset: int) -> CompletionLogprobs | None:
    """OpenAI legacy format; text_offset counts from the start of this choice's text."""
    if job.req.logprobs is None:
        return None
    out = CompletionLogprobs()
    top = top or []
    for k, (tid, lp) in enumerate(zip(ids, lps or [])):
        text = token_text(manager, tid)
        out.tokens.append(text)
        out.token_logprobs.append(lp)
        out.top_logprobs.append({token_text(manager, t): v for t, v in top[k]}
                                if k < len(top) else None)
        out.text_offset.append(offset)
        offset += len(text)
    return out


async def completion_response(manager: TokenizerManager, job: CompletionJob) -> CompletionResponse:
    states = await collect(manager.generate(job.inputs, stream=False), len(job.inputs))
    choices = [CompletionChoice(index=i, text=job.echo_texts[i] + s.text,
                                logprobs=_logprobs(manager, job, s.ids, s.logprobs, s.top_logprobs,
                                                   0),
                                finish_reason=s.finish_reason, stop_reason=s.matched)
               for i, s in enumerate(states)]
    return CompletionResponse(id=job.id, model=job.model, choices=choices,
                              usage=usage(states, job.req.n))


async def completion_stream(manager: TokenizerManager, job: CompletionJob
                            ) -> AsyncIterator[CompletionChunk]:
    def chunk(choices: list[CompletionChoice], **kw) -> CompletionChunk:
        return CompletionChunk(id=job.id, model=job.model, choices=choices, **kw)

    states = [ChoiceState() for _ in job.inputs]
    echoes = [CompletionChoice(index=i, text=t) for i, t in enumerate(job.echo_texts) if t]
    if echoes:
        yield chunk(echoes)
    async with aclosing(manager.generate(job.inputs, stream=True)) as outputs:
        async for i, out in outputs:
            offset = len(states[i].text)
            states[i].update(out)
            if not out.text_delta and out.finish_reason is None and job.req.logprobs is None:
                continue
            logprobs = _logprobs(manager, job, out.new_ids, out.logprobs, out.top_logprobs,
                                 offset)
            yield chunk([CompletionChoice(
                index=i, text=out.text_delta, finish_reason=out.finish_reason,
                stop_reason=out.finish_matched, logprobs=logprobs)])
    if job.req.include_usage:
        yield chunk([], usage=usage(states, job.req.n))
