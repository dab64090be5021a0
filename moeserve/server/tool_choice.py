"""`tool_choice` "required" or a named function: the reply is constrained by a JSON-schema grammar
built from the tools' `parameters`, so every call parses and validates.

- named function: the reply is that function's arguments object (schema = its `parameters`), and
  becomes one call of that name (vLLM's form);
- "required": the reply is a JSON array of `{"name": …, "arguments": …}` objects, one branch per
  tool (`anyOf`), at least one call and at most one when `parallel_tool_calls` is false (vLLM's and
  SGLang's form). The key is "parameters" for the llama3 parser, whose models are trained on it.
A tool's local `$ref`s are rewritten to where its schema sits in the array schema.

The replies are read by two more `ToolParser`s, so ChatOutputSpec and the streaming code treat
them like the model-format parsers: each call is sent once complete, whole, in OpenAI's delta form.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from moeserve.runtime.grammar import GrammarCompiler
from moeserve.server.protocol import APIError, Tool
from moeserve.server.tool_parsers import ToolParser

_DATA_KEYS = frozenset({"enum", "const", "default", "examples"})  # values there are not schemas
_NAMED = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def parameters(tool: Tool) -> dict[str, Any]:
    """A tool's parameter schema; OpenAI: no `parameters` means an empty parameter list."""
    p = tool.function.parameters
    return {"type": "object", "properties": {}} if p is None else p


def rebase_refs(schema: Any, base: str) -> Any:
    """A copy of `schema` whose local `$ref`s ("#…") point below `base` (a JSON pointer "#/…")."""
    if isinstance(schema, list):
        return [rebase_refs(v, base) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k == "$ref" and isinstance(v, str) and v.startswith("#"):
            out[k] = base + v[1:]
        elif k in _NAMED and isinstance(v, dict):  # name → schema (a property may be "default")
            out[k] = {name: rebase_refs(sub, base) for name, sub in v.items()}
        else:
            out[k] = v if k in _DATA_KEYS else rebase_refs(v, base)
    return out


def calls_schema(tools: list[Tool], parallel: bool, key: str = "arguments") -> dict[str, Any]:
    """The "required" reply: an array of calls, each `{"name": one tool, key: its arguments}`."""
    branches = []
    for i, t in enumerate(tools):
        base = f"#/items/anyOf/{i}/properties/{key}"
        branches.append({"type": "object", "properties": {
            "name": {"type": "string", "enum": [t.function.name]},
            key: rebase_refs(parameters(t), base)}, "required": ["name", key]})
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": branches}, "minItems": 1}
    return schema if parallel else schema | {"maxItems": 1}


class NamedArgsParser(ToolParser):
    """The whole reply is the arguments of `function`."""

    name = "named"

    def __init__(self, function: str):
        self.function = function

    def start(self, text: str) -> int | None:
        return 0 if text.strip() else None

    def hold(self, text: str) -> int:
        return len(text)

    def calls(self, tool_text: str, final: bool) -> list[tuple[str, Any]] | None:
        try:
            args = json.loads(tool_text)
        except json.JSONDecodeError:
            return None if final else []
        return [(self.function, args)]

    def format_prompt(self, tools: list[dict[str, Any]]) -> str:
        spec = json.dumps(tools[0].get("function", tools[0]))
        return f"Call this function:\n{spec}\nReply with only its arguments, as a JSON object."


class JsonCallsParser(ToolParser):
    """The whole reply is a JSON array of `{"name", "arguments" or "parameters"}` objects."""

    name = "json_calls"

    def __init__(self, key: str = "arguments"):
        self.key = key

    def start(self, text: str) -> int | None:
        return 0 if text.lstrip().startswith("[") else None

    def hold(self, text: str) -> int:
        return len(text)

    def calls(self, tool_text: str, final: bool) -> list[tuple[str, Any]] | None:
        text, decoder, out = tool_text.strip(), json.JSONDecoder(), []
        pos = 1  # after "["
        while True:
            while pos < len(text) and text[pos] in " \t\n\r,":
                pos += 1
            if pos == len(text) or text[pos] == "]":
                return out
            try:
                obj, pos = decoder.raw_decode(text, pos)
            except json.JSONDecodeError:
                return None if final and not out else out
            if not isinstance(obj, dict) or "name" not in obj:
                return None
            out.append((obj["name"], obj.get("arguments", obj.get("parameters", {}))))

    def format_prompt(self, tools: list[dict[str, Any]]) -> str:
        specs = "\n".join(json.dumps(t.get("function", t)) for t in tools)
        return (f"You can call these functions:\n{specs}\nReply with only a JSON array of calls: "
                f'[{{"name": NAME, "{self.key}": {{ARGUMENTS}}}}, ...].')


@dataclass(frozen=True)
class ForcedCalls:
    """What a forcing tool_choice needs: the grammar (kind, source) and the reply's parser."""

    grammar: tuple[str, str]
    parser: ToolParser


def forced_calls(compiler: GrammarCompiler, tools: list[Tool], named: bool, parallel: bool,
                 key: str = "arguments") -> ForcedCalls:
    """`tools` (for `named`, just the named one) → grammar and parser; the grammar is compiled
    here, so a schema the engine cannot compile is a 400 naming its tool."""
    if named:
        schema, parser = parameters(tools[0]), NamedArgsParser(tools[0].function.name)
    else:
        schema, parser = calls_schema(tools, parallel, key), JsonCallsParser(key)
    grammar = ("json_schema", json.dumps(schema))
    try:
        compiler.compile(grammar)
    except ValueError as e:
        culprit = _culprit(compiler, tools)
        where = "tools" if culprit is None else f"tool {culprit!r}: parameters"
        raise APIError(f"{where}: {e}", param="tools", code="invalid_grammar") from None
    return ForcedCalls(grammar, parser)


def _culprit(compiler: GrammarCompiler, tools: list[Tool]) -> str | None:
    """The first tool whose parameters alone do not compile (None if no grammar compiles)."""
    try:
        compiler.compile(("json_object", ""))
    except ValueError:
        return None
    for t in tools:
        try:
            compiler.compile(("json_schema", json.dumps(parameters(t))))
        except ValueError:
            return t.function.name
    return None
