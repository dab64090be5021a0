"""OpenAI-compatible response schemas (pydantic) and the OpenAI error body; the request schemas
live in request_models.py and are re-exported here."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, Field


class APIError(Exception):
    """A request error rendered as `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, message: str, status_code: int = 400, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message, self.status_code, self.param, self.type, self.code = (
            message, status_code, param, type, code)

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | int | None


class ErrorResponse(BaseModel):
    """Every 4xx/5xx body (OpenAI's format)."""

    error: ErrorDetail


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# ---- requests: request_models.py (re-exported here) ---------------------------------------------
from moeserve.server.request_models import (  # noqa: E402,F401
    MAX_TOP_LOGPROBS, ChatCompletionRequest, ChatMessage, CompletionRequest, DetokenizeRequest,
    FunctionDefinition, GenerateRequest, NamedFunction, NamedToolChoice, NativeSamplingParams,
    StreamOptions, TextPart, TokenizeRequest, Tool, ToolCallFunctionIn, ToolCallIn,
    _SamplingRequest)


# ---- responses -----------------------------------------------------------------------------------
class _Response(BaseModel):
    created: int = Field(default_factory=lambda: int(time.time()))


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class SpecUsage(BaseModel):
    """Extension: speculative decoding's counts (accept length = tokens per verify pass)."""

    verify_steps: int
    draft_tokens: int
    accepted_tokens: int
    accept_length: float


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None
    spec_decoding: SpecUsage | None = None

    @classmethod
    def of(cls, prompt: int, completion: int, cached: int,
           spec: list[int] | None = None) -> Usage:
        """`spec`: (verify steps, draft tokens, accepted tokens) when speculation ran."""
        ext = None if spec is None else SpecUsage(
            verify_steps=spec[0], draft_tokens=spec[1], accepted_tokens=spec[2],
            accept_length=round(spec[2] / max(spec[0], 1), 3))
        return cls(prompt_tokens=prompt, completion_tokens=completion,
                   total_tokens=prompt + completion,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
                   spec_decoding=ext)


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's prompt logprob entry (rank 1: the most likely token)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None  # vLLM extra
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop token id or string that matched (vLLM field)


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaToolCall(BaseModel):
    """OpenAI's streamed form: `index` always, id/type/name on a call's first chunk."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None  # vLLM extra


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None


class CompletionChunk(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    owned_by: str = "moeserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
