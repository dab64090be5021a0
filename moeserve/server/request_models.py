"""Request schemas (pydantic): what the routes accept, stated so /openapi.json tells the truth.

Every constraint the server enforces on a field is declared here (lengths, ranges, patterns,
which fields go together), so a request the document calls valid is served and one it calls
invalid gets a 400. Limits that depend on the served model (context, vocabulary, `server.max_n`)
are written into the document at start-up by openapi.py and checked by the routes. Validation is
strict (no "5" for 5, no 1 for true): the document's types are the accepted ones.

Unknown fields are ignored, as other OpenAI-compatible servers do. Two extras are accepted but not
described: `ebnf` grammars and /generate's `json_schema` string, whose validity only compiling
them decides (which JSON Schema cannot state); a bad one is a 400 naming the problem.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field
from pydantic.json_schema import SkipJsonSchema

MAX_TOP_LOGPROBS = 20
INT32_MAX = 2**31 - 1  # bound for counts that cross processes (msgspec packs 64-bit integers)


def _integral(value: Any) -> Any:
    """JSON Schema's integers include 5.0: take it as 5 (strict validation refuses the rest)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


# NOTE: after the Field in each Annotated: placed before it, pydantic writes the bounds into the
# JSON schema as "ge"/"le", which no client reads
INTEGRAL = BeforeValidator(_integral)

# x-* markers: limits of the served model, written in by openapi.py (and checked by the routes)
TokenId = Annotated[int, Field(ge=0, json_schema_extra={"x-token-id": True}), INTEGRAL]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
Text = Annotated[str, Field(min_length=1)]
TokenKey = Annotated[str, Field(pattern=r"^(0|[1-9][0-9]*)$",  # a token id written as a key
                                json_schema_extra={"x-token-key": True})]
Room = Annotated[int, Field(ge=0, lt=1 << 64), INTEGRAL]  # PD: pairs a prefill with a decode
MaxTokens0 = Annotated[int, Field(ge=0, json_schema_extra={"x-max-tokens": True}), INTEGRAL]
MaxTokens1 = Annotated[int, Field(ge=1, json_schema_extra={"x-max-tokens": True}), INTEGRAL]
NumChoices = Annotated[int, Field(ge=1, json_schema_extra={"x-max-n": True}), INTEGRAL]
ModelName = Annotated[str, Field(json_schema_extra={"x-model-name": True})]
Bias = Annotated[float, Field(ge=-100, le=100)]
# integers beyond 2**53 are not exact in every JSON client (a float64 compare lets 2**64 + 384
# pass a maximum of 2**64 - 1): seeds keep to the exact range
Seed = Annotated[int, Field(ge=-(2**53 - 1), le=2**53 - 1), INTEGRAL]
TopLogprobs = Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS), INTEGRAL]
TopK = Annotated[int, Field(ge=-1, le=INT32_MAX), INTEGRAL]  # 0 or -1: off
Penalty = Annotated[float, Field(ge=-2, le=2)]
Regex = Annotated[str, Field(json_schema_extra={"format": "regex"})]


def _if_then(condition: dict[str, Any], then: dict[str, Any]) -> dict[str, Any]:
    return {"if": condition, "then": then}


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Request):
    include_usage: bool = False


class JsonSchemaFormat(_Request):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")  # a JSON Schema the output must validate
    strict: bool | None = None


class TextFormat(_Request):
    type: Literal["text"]


class JsonObjectFormat(_Request):
    type: Literal["json_object"]


class JsonSchemaResponseFormat(_Request):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


ResponseFormat = Annotated[Union[TextFormat, JsonObjectFormat, JsonSchemaResponseFormat],
                           Field(discriminator="type")]
# Output constraints that cannot be combined: a JSON response_format, a regex, and (chat)
# tool_choice required or named each set the output's grammar
_JSON_FORMAT = {"required": ["response_format"], "properties": {"response_format": {
    "type": "object", "required": ["type"],
    "properties": {"type": {"enum": ["json_object", "json_schema"]}}}}}
_REGEX = {"required": ["regex"], "properties": {"regex": {"type": "string"}}}


def at_most_one(*conditions: dict[str, Any]) -> list[dict[str, Any]]:
    """JSON Schema: no two of `conditions` hold together."""
    return [{"not": {"allOf": [a, b]}} for i, a in enumerate(conditions)
            for b in conditions[i + 1:]]


class _Bootstrap(_Request):
    """PD disaggregation: SGLang's router adds these to what it sends a prefill and a decode
    server (docs/disaggregation.md); a colocated server ignores them. A list of rooms: one per
    prompt of a batch."""

    bootstrap_host: SkipJsonSchema[str | None] = None
    bootstrap_port: SkipJsonSchema[Annotated[int, Field(gt=0, lt=65536)] | None] = None
    bootstrap_room: SkipJsonSchema[Room | list[Room] | None] = None


class _SamplingRequest(_Bootstrap):
    """Fields shared by completions and chat completions."""

    model: ModelName | None = None  # this server's model (or none); others are 404
    max_tokens: MaxTokens1 | None = None  # a cap, at most server.max_completion_tokens
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: TopK | None = None
    min_p: float | None = Field(None, ge=0, le=1)
    n: NumChoices = 1  # at most server.max_n
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    seed: Seed | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    user: str | None = None
    presence_penalty: Penalty | None = 0.0
    frequency_penalty: Penalty | None = 0.0
    repetition_penalty: float | None = Field(1.0, gt=0, le=2)  # SGLang/vLLM extra
    logit_bias: dict[TokenKey, Bias] | None = None
    response_format: ResponseFormat | None = None
    regex: Regex | None = None  # SGLang extra: the output matches this regular expression
    ebnf: SkipJsonSchema[str | None] = None  # SGLang extra (see the module docstring)
    prompt_logprobs: TopLogprobs | None = None  # vLLM extra: the prompt tokens' logprobs

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingRequest):
    model_config = ConfigDict(extra="ignore", strict=True,
                              json_schema_extra={"allOf": at_most_one(_JSON_FORMAT, _REGEX)})

    prompt: Union[Text, TokenIds, Annotated[list[Text], Field(min_length=1)],
                  Annotated[list[TokenIds], Field(min_length=1)]]
    max_tokens: MaxTokens0 | None = None  # 0: score the prompt only (echo + logprobs)
    logprobs: TopLogprobs | None = None
    echo: bool = False  # the prompt is repeated before the completion (its logprobs too)
    suffix: str | None = Field(None, max_length=0)  # not implemented: only empty
    # not implemented: one sample per choice
    best_of: Annotated[int, Field(ge=1, le=1), INTEGRAL] | None = None


class TextPart(_Request):
    """A part of a multi-part `content` (text only: the server has no multimodal input)."""

    type: Literal["text"]
    text: str


class ToolCallFunctionIn(_Request):
    name: str
    arguments: str | dict[str, Any] = "{}"  # OpenAI sends a JSON string


class ToolCallIn(_Request):
    """A call in an earlier assistant turn, as OpenAI clients send it back."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunctionIn


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant turns that called tools
    tool_call_id: str | None = None  # role "tool": the call this result answers
    reasoning_content: str | None = None


class FunctionDefinition(_Request):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str  # one of the request's tools (else 404, as a model that does not exist)


class NamedToolChoice(_Request):
    type: Literal["function"] = "function"
    function: NamedFunction


_FORCED_TOOLS = {"required": ["tool_choice"], "properties": {"tool_choice": {
    "anyOf": [{"const": "required"}, {"type": "object"}]}}}
_CHAT_RULES = [
    # tool_choice other than "none" needs tools
    _if_then({"required": ["tool_choice"], "properties": {"tool_choice": {
        "not": {"enum": ["none", None]}}}},
             {"required": ["tools"], "properties": {"tools": {"type": "array"}}}),
    # top_logprobs above 0 needs logprobs
    _if_then({"required": ["top_logprobs"], "properties": {"top_logprobs": {
        "type": "integer", "minimum": 1}}},
             {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}),
    *at_most_one(_JSON_FORMAT, _REGEX, _FORCED_TOOLS),
]


class ChatCompletionRequest(_SamplingRequest):
    model_config = ConfigDict(extra="ignore", strict=True,
                              json_schema_extra={"allOf": _CHAT_RULES})

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: MaxTokens1 | None = None
    max_completion_tokens: MaxTokens1 | None = None
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None
    tools: list[Tool] | None = Field(None, min_length=1)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # e.g. {"enable_thinking": false}
    separate_reasoning: bool = True  # SGLang extra: false keeps <think>…</think> in content


class NativeSamplingParams(_Request):
    """/generate's SGLang-style sampling_params (unknown keys are refused)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    max_new_tokens: MaxTokens0 | None = None  # none: 128 (SGLang's)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: TopK = -1
    min_p: float = Field(0.0, ge=0, le=1)
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    frequency_penalty: Penalty = 0.0
    presence_penalty: Penalty = 0.0
    repetition_penalty: float = Field(1.0, gt=0, le=2)
    logit_bias: dict[TokenKey, Bias] | None = None
    n: NumChoices = 1
    regex: Regex | None = None
    json_schema: SkipJsonSchema[str | None] = None  # a JSON Schema as text (see the docstring)
    ebnf: SkipJsonSchema[str | None] = None

    def grammar(self) -> list[tuple[str, str]]:
        """The (kind, source) constraints given: at most one is allowed."""
        return [(k, v) for k, v in (("json_schema", self.json_schema), ("regex", self.regex),
                                    ("ebnf", self.ebnf)) if v is not None]


def _exactly_one(a: str, b: str) -> dict[str, Any]:
    """JSON Schema: exactly one of the properties `a`, `b` is present and not null."""
    present = [{"required": [k], "properties": {k: {"not": {"type": "null"}}}} for k in (a, b)]
    return {"oneOf": present}


class GenerateRequest(_Bootstrap):
    """The native /generate request: text or token ids, SGLang-style sampling_params."""

    model_config = ConfigDict(extra="ignore", strict=True,
                              json_schema_extra=_exactly_one("text", "input_ids"))

    text: Union[Text, Annotated[list[Text], Field(min_length=1)], None] = None
    input_ids: Union[TokenIds, Annotated[list[TokenIds], Field(min_length=1)], None] = None
    sampling_params: NativeSamplingParams = Field(default_factory=NativeSamplingParams)
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: TopLogprobs = 0
    # with return_logprob: prompt logprobs from this position on (none at -1)
    logprob_start_len: Annotated[int, Field(ge=-1, le=INT32_MAX), INTEGRAL] = -1
    return_text_in_logprobs: bool = False


class TokenizeRequest(_Request):
    """vLLM's /tokenize: a prompt, or chat messages rendered through the chat template."""

    model_config = ConfigDict(extra="ignore", strict=True,
                              json_schema_extra=_exactly_one("prompt", "messages"))

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[TokenId]
