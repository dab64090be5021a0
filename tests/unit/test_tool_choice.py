"""tool_choice required / named: the array schema built from the tools (checked with `jsonschema`
and compiled by xgrammar), `$ref` rebasing, the reply parsers whole and streamed, and the 400
naming a tool whose schema does not compile."""

from __future__ import annotations

import json

import pytest

from moeserve.server.protocol import APIError, Tool
from moeserve.server.tool_choice import (JsonCallsParser, NamedArgsParser, calls_schema,
                                         forced_calls, rebase_refs)
from moeserve.server.tool_parsers import StreamingToolParser, parse_tool_calls

jsonschema = pytest.importorskip("jsonschema")

POINT = {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
         "required": ["x"]}
TOOLS = [Tool.model_validate({"type": "function", "function": f}) for f in [
    {"name": "move", "parameters": {"type": "object", "required": ["to", "speed"], "properties": {
        "to": {"$ref": "#/$defs/P"}, "speed": {"enum": ["slow", "fast"]}}, "$defs": {"P": POINT}}},
    {"name": "tree", "parameters": {"type": "object", "required": ["v"], "properties": {  # "#"
        "v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#"}}}}},
    {"name": "ping"}]]  # no parameters: an empty parameter list


def valid(instance, schema) -> bool:
    try:
        jsonschema.validate(instance, schema)
    except jsonschema.ValidationError:
        return False
    return True


def test_calls_schema_accepts_exactly_valid_calls():
    schema = calls_schema(TOOLS, parallel=True)
    move = {"name": "move", "arguments": {"to": {"x": 3}, "speed": "fast"}}
    tree = {"name": "tree", "arguments": {"v": 1, "kids": [{"v": 2, "kids": [{"v": 3}]}]}}
    assert valid([move, tree, {"name": "ping", "arguments": {}}], schema)
    for bad in [[], [{"name": "move", "arguments": {"to": {"x": 10}, "speed": "fast"}}],
                [{"name": "move", "arguments": {"to": {"x": 1}}}],  # a required field missing
                [{"name": "tree", "arguments": {"v": 1, "kids": [{"v": "no"}]}}],
                [{"name": "fly", "arguments": {}}], [{"name": "ping", "parameters": {}}]]:
        assert not valid(bad, schema), bad
    assert not valid([move, move], calls_schema(TOOLS, parallel=False))
    assert valid([move], calls_schema(TOOLS, parallel=False))
    key = calls_schema(TOOLS, parallel=True, key="parameters")
    assert valid([{"name": "ping", "parameters": {}}], key)


def test_rebase_refs_leaves_data_alone():
    schema = {"properties": {"a": {"$ref": "#/$defs/A"}, "b": {"$ref": "other.json#/x"},
                             "c": {"const": {"$ref": "#/data"}}, "default": {"$ref": "#/$defs/A"}}}
    out = rebase_refs(schema, "#/items/0")
    assert out["properties"]["a"]["$ref"] == "#/items/0/$defs/A"
    assert out["properties"]["default"]["$ref"] == "#/items/0/$defs/A"  # a property, not data
    assert out["properties"]["b"]["$ref"] == "other.json#/x"  # not local
    assert out["properties"]["c"] == {"const": {"$ref": "#/data"}}
    assert schema["properties"]["a"]["$ref"] == "#/$defs/A"  # a copy


def test_xgrammar_compiles_the_array_schema():
    xgr = pytest.importorskip("xgrammar")
    xgr.Grammar.from_json_schema(json.dumps(calls_schema(TOOLS, parallel=False)),
                                 any_whitespace=False)


def stream(parser, text: str, names: set[str]) -> tuple[str, list[list]]:
    """Character by character: (content, the calls each feed/finish released)."""
    sp, content, released = StreamingToolParser(parser, names), "", []
    for ch in text:
        more, calls = sp.feed(ch)
        content += more
        released.append([(c.name, json.loads(c.arguments)) for c in calls])
    more, calls = sp.finish()
    released.append([(c.name, json.loads(c.arguments)) for c in calls])
    return content + more, released


def test_json_calls_parser_whole_and_streamed():
    names = {"move", "ping"}
    text = '[{"name": "move", "arguments": {"to": {"x": 1}}}, {"name": "ping", "parameters": {}}]'
    content, calls = parse_tool_calls(JsonCallsParser(), text, names)
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("move", {"to": {"x": 1}}), ("ping", {})]
    content, released = stream(JsonCallsParser(), text, names)
    first = text.index("}}}") + 3  # the first call is released by its closing brace
    assert content == "" and released[first - 1] == [("move", {"to": {"x": 1}})]
    assert [r for r in released if r] == [[("move", {"to": {"x": 1}})], [("ping", {})]]
    cut = text[:first + 10]  # cut short (max_tokens): the complete call is still a call
    assert [c.name for c in parse_tool_calls(JsonCallsParser(), cut, names)[1]] == ["move"]
    assert parse_tool_calls(JsonCallsParser(), '[{"name": "mo', names) == ('[{"name": "mo', [])


def test_named_args_parser_whole_and_streamed():
    text = '{"to": {"x": 1}, "speed": "slow"}'
    content, released = stream(NamedArgsParser("move"), text, {"move"})
    assert content == "" and [r for r in released if r] == [
        [("move", {"to": {"x": 1}, "speed": "slow"})]]
    assert released[len(text) - 1]  # released by the closing brace, before finish()
    content, released = stream(NamedArgsParser("move"), text[:-3], {"move"})
    assert content == text[:-3] and not any(released)  # truncated arguments stay content


class FakeCompiler:
    """Compiles everything except schemas mentioning "bogus"."""

    def compile(self, spec: tuple[str, str]) -> str:
        if "bogus" in spec[1]:
            raise ValueError('invalid json_schema: Unsupported type "bogus"')
        return "compiled"


def test_forced_calls_names_the_tool_that_does_not_compile():
    bogus = Tool.model_validate({"type": "function", "function": {
        "name": "broken", "parameters": {"type": "bogus"}}})
    with pytest.raises(APIError) as e:
        forced_calls(FakeCompiler(), TOOLS + [bogus], named=False, parallel=True)
    assert e.value.param == "tools" and "'broken'" in e.value.message
    assert "bogus" in e.value.message and e.value.code == "invalid_grammar"
    named = forced_calls(FakeCompiler(), TOOLS[2:], named=True, parallel=True)
    assert json.loads(named.grammar[1]) == {"type": "object", "properties": {}}
    assert isinstance(named.parser, NamedArgsParser) and named.parser.function == "ping"
