"""/v1/completions: prompts (text or ids, one or many) → sub-requests → response or chunk stream."""

from __future__ import annotations

import codecs
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from moeserve.server.protocol import (APIError, CompletionChoice, CompletionChunk,
                                      CompletionLogprobs, CompletionRequest, CompletionResponse,
                                      new_id)
from moeserve.server.serving_common import (ChoiceState, check_request, check_top_logprobs,
                                            collect, pd_of, response_model, sampling_params, token_text,
                                            usage, vllm_prompt_logprobs)
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
    """echo + logprobs (how evaluation harnesses score: max_tokens 0 or 1) and vLLM's
    prompt_logprobs ask the scheduler for the prompt's logprobs, computed in its prefill."""
    check_request(manager, req)
    top = check_top_logprobs(req.logprobs, "logprobs")
    prompt_top = check_top_logprobs(req.prompt_logprobs, "prompt_logprobs")
    echo_scores = req.echo and req.logprobs is not None
    scores = echo_scores or req.prompt_logprobs is not None
    inputs: list[GenInput] = []
    for ids in _prompt_ids(manager, req.prompt):
        manager.check_ids(ids, "prompt")
        max_new = manager.resolve_max_tokens(len(ids), req.max_tokens, "prompt", minimum=0)
        sampling = sampling_params(manager, req, max_new)
        inputs.append(GenInput(ids, sampling, req.logprobs is not None, top,
                               0 if scores else -1, max(top if echo_scores else 0, prompt_top)))
    echo = [manager.tokenizer.decode(x.input_ids, skip_special_tokens=True) if req.echo else ""
            for x in inputs for _ in range(req.n)]
    return CompletionJob(req, expand_n(inputs, req.n, pd_of(req)), echo, new_id("cmpl"),
                         response_model(manager, req))


def _logprobs(manager: TokenizerManager, job: CompletionJob, ids: list[int],
              lps: list[float | None] | None, top: list | None, offset: int
              ) -> CompletionLogprobs | None:
    """OpenAI legacy format; text_offset counts characters from the start of this choice's text
    (a token that ends inside a character adds none)."""
    if job.req.logprobs is None:
        return None
    out = CompletionLogprobs()
    top = top or []
    chars = codecs.getincrementaldecoder("utf-8")(errors="replace")
    for k, (tid, lp) in enumerate(zip(ids, lps or [])):
        out.tokens.append(token_text(manager, tid))
        out.token_logprobs.append(lp)
        alts = top[k] if k < len(top) else None
        out.top_logprobs.append(None if alts is None or lp is None else
                                {token_text(manager, t): v for t, v in alts})
        out.text_offset.append(offset)
        offset += len(chars.decode(manager.token_bytes.bytes_of(tid)))
    return out


def _echoed(manager: TokenizerManager, job: CompletionJob, i: int, s: ChoiceState
            ) -> CompletionLogprobs | None:
    """The prompt's part of choice i's logprobs (echo), then the completion's."""
    ids = job.inputs[i].input_ids
    if not (job.req.echo and job.req.logprobs is not None and s.input_logprobs is not None):
        return _logprobs(manager, job, s.ids, s.logprobs, s.top_logprobs, len(job.echo_texts[i]))
    prompt = _logprobs(manager, job, ids, s.input_logprobs, s.input_top_logprobs, 0)
    gen = _logprobs(manager, job, s.ids, s.logprobs, s.top_logprobs, len(job.echo_texts[i]))
    for name in CompletionLogprobs.model_fields:
        getattr(prompt, name).extend(getattr(gen, name))
    return prompt


def _choice(manager: TokenizerManager, job: CompletionJob, i: int, s: ChoiceState,
            text: str) -> CompletionChoice:
    prompt_lps = None if job.req.prompt_logprobs is None else vllm_prompt_logprobs(
        manager, job.inputs[i].input_ids, s, job.req.prompt_logprobs)
    return CompletionChoice(index=i, text=text, logprobs=_echoed(manager, job, i, s),
                            prompt_logprobs=prompt_lps, finish_reason=s.finish_reason,
                            stop_reason=s.matched)


async def completion_response(manager: TokenizerManager, job: CompletionJob) -> CompletionResponse:
    states = await collect(manager.generate(job.inputs, stream=False), len(job.inputs))
    choices = [_choice(manager, job, i, s, job.echo_texts[i] + s.text)
               for i, s in enumerate(states)]
    return CompletionResponse(id=job.id, model=job.model, choices=choices,
                              usage=usage(states, job.req.n))


async def completion_stream(manager: TokenizerManager, job: CompletionJob
                            ) -> AsyncIterator[CompletionChunk]:
    def chunk(choices: list[CompletionChoice], **kw) -> CompletionChunk:
        return CompletionChunk(id=job.id, model=job.model, choices=choices, **kw)

    states = [ChoiceState() for _ in job.inputs]
    scored = job.inputs[0].logprob_start_len >= 0 if job.inputs else False
    if not scored:  # the echo goes out at once; with prompt logprobs, with them (first output)
        echoes = [CompletionChoice(index=i, text=t) for i, t in enumerate(job.echo_texts) if t]
        if echoes:
            yield chunk(echoes)
    async with aclosing(manager.generate(job.inputs, stream=True)) as outputs:
        async for i, out in outputs:
            first = not states[i].ids and states[i].input_logprobs is None
            states[i].update(out)
            if scored and first:
                yield chunk([_choice(manager, job, i, ChoiceState(
                    input_logprobs=out.input_logprobs, input_top_logprobs=out.input_top_logprobs,
                    input_ranks=out.input_ranks), job.echo_texts[i])])
            if not out.text_delta and out.finish_reason is None and job.req.logprobs is None:
                continue
            offset = len(job.echo_texts[i]) + len(states[i].text) - len(out.text_delta)
            logprobs = _logprobs(manager, job, out.new_ids, out.logprobs, out.top_logprobs,
                                 offset)
            yield chunk([CompletionChoice(
                index=i, text=out.text_delta, finish_reason=out.finish_reason,
                stop_reason=out.finish_matched, logprobs=logprobs)])
    if job.req.include_usage:
        yield chunk([], usage=usage(states, job.req.n))
