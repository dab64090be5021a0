"""/openapi.json as this server enforces it.

FastAPI writes the document from the routes and the request models (request_models.py, whose
fields carry their static constraints); here it is completed with what only the running server
knows, the way the routes check it:
- the served model's limits, where the models marked them (`x-*` keys): token ids below the
  vocabulary size (as numbers and as logit_bias keys), max_tokens up to
  `max_completion_tokens`, `n` up to `server.max_n`, the model names accepted;
- without a tool-call parser, tools need tool_choice "none", "required" or a named function;
- /generate's body (the route parses it itself, whatever the Content-Type);
- errors are OpenAI's body with a 4xx (FastAPI's 422 is never sent: validation errors are 400).
The routes document their own responses (api.py: `errors`, streaming, text/plain metrics).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from moeserve.config import MoeserveConfig
from moeserve.server.protocol import ChatCompletionChunk, CompletionChunk
from moeserve.server.request_models import GenerateRequest
from moeserve.server.serving_common import model_names
from moeserve.server.tokenizer_manager import TokenizerManager
from moeserve.server.tool_parsers import make_parser

Schema = dict[str, Any]


def install_openapi(app: FastAPI, manager: TokenizerManager, cfg: MoeserveConfig) -> None:
    def openapi() -> Schema:
        if app.openapi_schema is None:
            with warnings.catch_warnings():  # routes with two methods: renamed in `complete`
                warnings.filterwarnings("ignore", "Duplicate Operation ID")
                doc = get_openapi(title="moeserve", version="0.1.0", routes=app.routes)
            app.openapi_schema = complete(doc, manager, cfg)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def complete(doc: Schema, manager: TokenizerManager, cfg: MoeserveConfig) -> Schema:
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for model in (GenerateRequest, CompletionChunk, ChatCompletionChunk):
        _add_model(schemas, model)
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
            if op.get("security"):
                responses["401"] = {"description": "Missing or wrong API key", "content": {
                    "application/json": {"schema": {"$ref": ERROR_REF}}}}
            stream = responses.get("200", {}).get("content", {}).get("text/event-stream")
            if stream is not None:
                stream["schema"] = sse_event(STREAM_CHUNKS.get(path))
            op["operationId"] = re.sub(r"[^A-Za-z0-9]+", "_", f"{method}{path}").strip("_")
    markers = {
        "x-token-id": lambda s: s.update(maximum=manager.vocab_size - 1),
        "x-token-key": lambda s: s.update(pattern=at_most_pattern(manager.vocab_size - 1)),
        "x-max-tokens": lambda s: s.update(maximum=manager.max_completion_tokens),
        "x-max-n": lambda s: s.update(maximum=cfg.server.max_n),
        "x-model-name": lambda s: (s.pop("type", None), s.update(
            enum=[m for m in model_names(manager) if m is not None])),
    }
    _resolve_markers(schemas, markers)
    if make_parser(cfg.server.tool_parser, manager.tokenizer.chat_template) is None:
        schemas["ChatCompletionRequest"].setdefault("allOf", []).append(NO_PARSER_RULE)
    return doc


ERROR_REF = "#/components/schemas/ErrorResponse"
STREAM_CHUNKS = {"/v1/completions": "CompletionChunk", "/v1/chat/completions":
                 "ChatCompletionChunk"}


def sse_event(chunk: str | None) -> Schema:
    """One server-sent event (OpenAPI 3.1 describes the events of a stream one at a time)."""
    what = f"a {chunk} (components)" if chunk else "a result"
    data = {"type": "string", "description": f"JSON: {what}, or an error body; `[DONE]` last"}
    return {"type": "object", "required": ["data"],
            "properties": {"data": data, "event": {"type": "string"}}}


# tools without a parser: only forced calls (or none) can be read back from the reply
NO_PARSER_RULE = {"if": {"required": ["tools"], "properties": {"tools": {"type": "array"}}},
                  "then": {"required": ["tool_choice"],
                           "properties": {"tool_choice": {"not": {"enum": ["auto", None]}}}}}


def _add_model(schemas: Schema, model: type) -> None:
    """A pydantic model (and the models it uses) as document components."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    for name, sub in schema.pop("$defs", {}).items():
        schemas.setdefault(name, sub)
    schemas[model.__name__] = schema


def _resolve_markers(node: Any, markers: dict[str, Callable[[Schema], Any]]) -> None:
    """Apply (and drop) every `x-*` marker found anywhere under `node`."""
    if isinstance(node, dict):
        for key, fill in markers.items():
            if node.pop(key, False):
                fill(node)
        for value in node.values():
            _resolve_markers(value, markers)
    elif isinstance(node, list):
        for value in node:
            _resolve_markers(value, markers)


def at_most_pattern(m: int) -> str:
    """A regular expression matching the decimal integers 0..m (no leading zeros)."""
    digits = str(m)
    alts = ["0"]
    if len(digits) > 1:  # every shorter number from 1 on
        alts.append(f"[1-9][0-9]{{0,{len(digits) - 2}}}")
    for i, ch in enumerate(digits):  # as long as m: below m's digit at i, same digits before
        low, d = (1 if i == 0 else 0), int(ch)
        if d > low:
            alts.append(f"{digits[:i]}[{low}-{d - 1}][0-9]{{{len(digits) - i - 1}}}")
    alts.append(digits)
    return "^(" + "|".join(dict.fromkeys(alts)) + ")$"
