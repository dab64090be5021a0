"""/v1/chat/completions: chat template (with tools) → sub-requests → one response or a chunk
stream, the text split into reasoning, content and tool calls (chat_output.py); tool_choice
required or named constrains the reply with a grammar (tool_choice.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from moeserve.server.chat_messages import message_dict
from moeserve.server.chat_output import ChatOutputSpec, ChatParts
from moeserve.server.protocol import (APIError, AssistantMessage, ChatChoice, ChatCompletionChunk,
                                      ChatCompletionRequest, ChatCompletionResponse, ChatLogprobs,
                                      ChatStreamChoice, DeltaMessage, DeltaToolCall, FunctionCall,
                                      NamedToolChoice, ToolCallOut, new_id)
from moeserve.server.reasoning import STYLES
from moeserve.server.serving_common import (ChoiceState, chat_logprobs, check_request,
                                            check_top_logprobs, collect, pd_of, response_model,
                                            sampling_params, usage, vllm_prompt_logprobs)
from moeserve.server.tokenizer_manager import GenInput, TokenizerManager, expand_n
from moeserve.server.tool_choice import forced_calls
from moeserve.server.tool_parsers import make_parser


@dataclass
class ChatJob:
    """A validated chat request, ready to run."""

    req: ChatCompletionRequest
    inputs: list[GenInput]
    id: str
    model: str
    output: ChatOutputSpec


def _tools(manager: TokenizerManager, req: ChatCompletionRequest
           ) -> tuple[list[dict[str, Any]] | None, ChatOutputSpec, tuple[str, str] | None]:
    """The tools offered to the template, how replies are parsed and, for tool_choice required or
    named, the grammar that forces the calls (tool_choice.py), from tools/tool_choice."""
    choice = req.tool_choice or ("auto" if req.tools else "none")
    style = STYLES.get(manager.cfg.server.reasoning_parser or "") if req.separate_reasoning \
        else None
    if choice == "none" or not req.tools:
        if choice != "none":
            raise APIError("tool_choice needs tools", param="tool_choice")
        return None, ChatOutputSpec(reasoning=style), None
    tools, named = req.tools, isinstance(choice, NamedToolChoice)
    if named:
        tools = [t for t in tools if t.function.name == choice.function.name]
        if not tools:
            raise APIError(f"tool_choice names {choice.function.name!r}, which is not in tools",
                           status_code=404, param="tool_choice", code="tool_not_found")
    parser = make_parser(manager.cfg.server.tool_parser, manager.tokenizer.chat_template)
    names, offered = frozenset(t.function.name for t in tools), [
        t.model_dump(exclude_none=True) for t in tools]
    if named or choice == "required":  # no reasoning: the grammar holds from the first token
        key = "parameters" if parser is not None and parser.name == "llama3" else "arguments"
        forced = forced_calls(manager.grammars, tools, named, req.parallel_tool_calls, key)
        return offered, ChatOutputSpec(None, forced.parser, names, req.parallel_tool_calls), \
            forced.grammar
    if parser is None:
        raise APIError("tools need a tool-call parser: this model's chat template has no known "
                       "tool format; start the server with server.tool_parser=hermes, "
                       "deepseek_v3 or llama3 (tool_choice required or named needs none)",
                       param="tools")
    return offered, ChatOutputSpec(style, parser, names, req.parallel_tool_calls), None


def _messages(manager: TokenizerManager, req: ChatCompletionRequest,
              tools: list[dict[str, Any]] | None, spec: ChatOutputSpec) -> list[dict[str, Any]]:
    """Message dicts; a template that cannot render tools gets them in a system prompt written
    in the parser's format (SmolLM2's, for instance)."""
    msgs = [message_dict(m) for m in req.messages]
    if tools and spec.tools is not None and "tools" not in (manager.tokenizer.chat_template or ""):
        prompt = spec.tools.format_prompt(tools)
        if msgs[0]["role"] == "system":
            msgs[0] = msgs[0] | {"content": f"{msgs[0]['content']}\n\n{prompt}"}
        else:
            msgs.insert(0, {"role": "system", "content": prompt})
    return msgs


def prepare_chat(manager: TokenizerManager, req: ChatCompletionRequest) -> ChatJob:
    check_request(manager, req)
    top = check_top_logprobs(req.top_logprobs, "top_logprobs")
    if top and not req.logprobs:
        raise APIError("top_logprobs needs logprobs=true", param="top_logprobs")
    tools, spec, tool_grammar = _tools(manager, req)
    template_tools = tools if "tools" in (manager.tokenizer.chat_template or "") else None
    ids = manager.apply_chat_template(_messages(manager, req, tools, spec), template_tools,
                                      req.chat_template_kwargs, parser=spec.tools)
    manager.check_ids(ids, "messages")
    if req.max_tokens is not None:  # checked even when max_completion_tokens wins
        manager.resolve_max_tokens(len(ids), req.max_tokens, "messages")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
        else req.max_tokens
    max_new = manager.resolve_max_tokens(len(ids), max_tokens, "messages")
    prompt_top = check_top_logprobs(req.prompt_logprobs, "prompt_logprobs")
    base = GenInput(ids, sampling_params(manager, req, max_new, tool_grammar), req.logprobs, top,
                    -1 if req.prompt_logprobs is None else 0, prompt_top)
    return ChatJob(req, expand_n([base], req.n, pd_of(req)), new_id("chatcmpl"), response_model(manager, req),
                   spec)


def _finish_reason(reason: str | None, called: bool) -> str | None:
    return "tool_calls" if called and reason == "stop" else reason


def _message(job: ChatJob, text: str) -> tuple[AssistantMessage, bool]:
    reasoning, content, calls = job.output.parse(text)
    tool_calls = [ToolCallOut(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
                  for c in calls] or None
    return AssistantMessage(content=None if calls and not content.strip() else content,
                            reasoning_content=reasoning, tool_calls=tool_calls), bool(calls)


def _delta(parts: ChatParts, first_index: int) -> DeltaMessage:
    calls = [DeltaToolCall(index=first_index + k, id=c.id, type="function",
                           function=FunctionCall(name=c.name, arguments=c.arguments))
             for k, c in enumerate(parts.calls)] or None
    return DeltaMessage(content=parts.content or None, reasoning_content=parts.reasoning or None,
                        tool_calls=calls)


def _logprobs(manager: TokenizerManager, job: ChatJob, ids: list[int], lps: list[float] | None,
              top: list | None) -> ChatLogprobs | None:
    if not job.req.logprobs:
        return None
    return ChatLogprobs(content=chat_logprobs(manager, ids, lps or [], top or []))


async def chat_response(manager: TokenizerManager, job: ChatJob) -> ChatCompletionResponse:
    states = await collect(manager.generate(job.inputs, stream=False), len(job.inputs))
    choices = []
    for i, s in enumerate(states):
        message, called = _message(job, s.text)
        choices.append(ChatChoice(
            index=i, message=message, finish_reason=_finish_reason(s.finish_reason, called),
            logprobs=_logprobs(manager, job, s.ids, s.logprobs, s.top_logprobs),
            stop_reason=s.matched))
    prompt_lps = None if job.req.prompt_logprobs is None else vllm_prompt_logprobs(
        manager, job.inputs[0].input_ids, states[0], job.req.prompt_logprobs)
    return ChatCompletionResponse(id=job.id, model=job.model, choices=choices,
                                  usage=usage(states, job.req.n), prompt_logprobs=prompt_lps)


async def chat_stream(manager: TokenizerManager, job: ChatJob
                      ) -> AsyncIterator[ChatCompletionChunk]:
    """Role chunk per choice, content deltas, a finish chunk per choice, then optional usage."""
    def chunk(choices: list[ChatStreamChoice], **kw: Any) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=job.id, model=job.model, choices=choices, **kw)

    states = [ChoiceState() for _ in job.inputs]
    streams = [job.output.stream() for _ in job.inputs]
    yield chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                 for i in range(len(job.inputs))])
    async with aclosing(manager.generate(job.inputs, stream=True)) as outputs:
        async for i, out in outputs:
            states[i].update(out)
            first_call = streams[i].num_calls
            parts = streams[i].feed(out.text_delta)
            if out.finish_reason is not None:
                parts += streams[i].finish()
            delta = _delta(parts, first_call)
            if (delta.content is None and delta.reasoning_content is None and not delta.tool_calls
                    and out.finish_reason is None and not job.req.logprobs):
                continue
            yield chunk([ChatStreamChoice(
                index=i, delta=delta, stop_reason=out.finish_matched,
                finish_reason=_finish_reason(out.finish_reason, streams[i].num_calls > 0),
                logprobs=_logprobs(manager, job, out.new_ids, out.logprobs, out.top_logprobs))])
    if job.req.include_usage:
        yield chunk([], usage=usage(states, job.req.n))
