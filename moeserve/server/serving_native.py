"""The native /generate route (SGLang-style): text or input_ids, a sampling_params dict, and results
with `text`, `output_ids` and `meta_info`. Streaming sends cumulative text and ids per event."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from moeserve.core import SamplingParams, spec_meta
from moeserve.server.protocol import APIError, GenerateRequest, NativeSamplingParams, new_id
from moeserve.server.serving_common import (ChoiceState, check_top_logprobs, collect, pd_of,
                                            token_text)
from moeserve.server.tokenizer_manager import GenInput, TokenizerManager, expand_n


DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's, when sampling_params has none


@dataclasses.dataclass
class NativeJob:
    inputs: list[GenInput]
    batched: bool  # the request held a list of prompts: answer with a list
    id: str
    text_in_logprobs: bool = False  # return_text_in_logprobs


def _prompts(manager: TokenizerManager, req: GenerateRequest) -> tuple[list[list[int]], bool]:
    if (req.text is None) == (req.input_ids is None):
        raise APIError("pass exactly one of text or input_ids", param="text")
    if isinstance(req.text, str):
        return [manager.tokenize(req.text)], False
    if req.text is not None:
        return [manager.tokenize(t) for t in req.text], True
    ids = req.input_ids or []
    if ids and isinstance(ids[0], list):
        return [list(x) for x in ids], True
    return [list(ids)], False


def _grammar(manager: TokenizerManager, params: NativeSamplingParams) -> tuple[str, str] | None:
    """SGLang's sampling_params json_schema / regex / ebnf (strings), compiled now for the 400."""
    found = params.grammar()
    if not found:
        return None
    if len(found) > 1:
        raise APIError("sampling_params: give one of json_schema, regex, ebnf",
                       param="sampling_params")
    try:
        manager.grammars.compile(found[0])
    except ValueError as e:
        raise APIError(f"sampling_params: {e}", param=f"sampling_params.{found[0][0]}") from None
    return found[0]


def _sampling(manager: TokenizerManager, params: NativeSamplingParams) -> SamplingParams:
    """The typed sampling_params as the scheduler's SamplingParams (top_k 0 means off)."""
    fields = params.model_dump(exclude={"n", "regex", "json_schema", "ebnf"})
    if params.max_new_tokens is None:
        fields["max_new_tokens"] = min(DEFAULT_MAX_NEW_TOKENS, manager.max_completion_tokens)
    fields["top_k"] = -1 if params.top_k == 0 else params.top_k
    fields["logit_bias"] = fields["logit_bias"] or ()
    fields["stop"], fields["stop_token_ids"] = fields["stop"] or (), fields["stop_token_ids"] or ()
    try:
        sampling = SamplingParams.from_dict({**fields, "grammar": _grammar(manager, params)})
    except (ValueError, TypeError) as e:
        raise APIError(f"sampling_params: {e}", param="sampling_params") from e
    if sampling.logit_bias:
        manager.check_ids([t for t, _ in sampling.logit_bias], "sampling_params.logit_bias")
    if sampling.stop_token_ids:
        manager.check_ids(list(sampling.stop_token_ids), "sampling_params.stop_token_ids")
    return sampling


def prepare_native(manager: TokenizerManager, req: GenerateRequest) -> NativeJob:
    n = req.sampling_params.n
    manager.check_n(n)
    sampling = _sampling(manager, req.sampling_params)
    top = check_top_logprobs(req.top_logprobs_num, "top_logprobs_num")
    prompts, batched = _prompts(manager, req)
    start = req.logprob_start_len if req.return_logprob else -1
    inputs = []
    for ids in prompts:
        manager.check_ids(ids, "input_ids" if req.input_ids is not None else "text")
        max_new = manager.resolve_max_tokens(len(ids), sampling.max_new_tokens, "prompt",
                                             minimum=0)
        inputs.append(GenInput(ids, dataclasses.replace(sampling, max_new_tokens=max_new),
                               req.return_logprob, top, min(start, len(ids)), top))
    return NativeJob(expand_n(inputs, n, pd_of(req)), batched or n > 1, new_id("gen"),
                     req.return_text_in_logprobs)


def _triples(manager: TokenizerManager, job: NativeJob, lps: list, ids: list[int]) -> list:
    """SGLang's logprob entries: [logprob, token id, its text or None]."""
    text = (lambda t: token_text(manager, t)) if job.text_in_logprobs else (lambda t: None)
    return [[lp, t, text(t)] for lp, t in zip(lps, ids)]


def _logprob_meta(manager: TokenizerManager, job: NativeJob, i: int, s: ChoiceState
                  ) -> dict[str, Any]:
    """SGLang's meta_info logprob fields (input ones from logprob_start_len on)."""
    def tops(rows: list | None) -> list:
        return [None if r is None else _triples(manager, job, [v for _, v in r], [t for t, _ in r])
                for r in rows or []]

    x = job.inputs[i]
    meta = {"output_token_logprobs": _triples(manager, job, s.logprobs, s.ids),
            "output_top_logprobs": tops(s.top_logprobs)}
    if x.logprob_start_len >= 0:
        meta["input_token_logprobs"] = _triples(manager, job, s.input_logprobs or [],
                                                x.input_ids[x.logprob_start_len:])
        meta["input_top_logprobs"] = tops(s.input_top_logprobs) if s.input_top_logprobs else [
            None if v is None else [] for v in s.input_logprobs or []]
    return meta


def _result(manager: TokenizerManager, job: NativeJob, i: int, s: ChoiceState
            ) -> dict[str, Any]:
    finish = None if s.finish_reason is None else {"type": s.finish_reason, "matched": s.matched}
    meta = {"id": f"{job.id}-{i}", "finish_reason": finish, "prompt_tokens": s.prompt_tokens,
            "completion_tokens": s.completion_tokens, "cached_tokens": s.cached_tokens}
    if s.spec[0]:
        meta.update(spec_meta(*s.spec))
    if job.inputs[i].return_logprob:
        meta.update(_logprob_meta(manager, job, i, s))
    return {"text": s.text, "output_ids": s.ids, "meta_info": meta} | (
        {"index": i} if job.batched else {})


async def native_response(manager: TokenizerManager, job: NativeJob) -> Any:
    states = await collect(manager.generate(job.inputs, stream=False), len(job.inputs))
    results = [_result(manager, job, i, s) for i, s in enumerate(states)]
    return results if job.batched else results[0]


async def native_stream(manager: TokenizerManager, job: NativeJob
                        ) -> AsyncIterator[dict[str, Any]]:
    states = [ChoiceState() for _ in job.inputs]
    async with aclosing(manager.generate(job.inputs, stream=True)) as outputs:
        async for i, out in outputs:
            states[i].update(out)
            yield _result(manager, job, i, states[i])
