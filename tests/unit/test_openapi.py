"""/openapi.json is completed with the served model's limits (no server: a stand-in manager): the
token-id bound as numbers and as logit_bias keys, max_tokens and n maxima, the accepted model
names, 401 only where an API key guards the route, no FastAPI 422, unique operation ids, and the
tools rule only without a tool-call parser. The logit_bias key pattern is checked against every
integer around the vocabulary size."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest

from moeserve.config import compose
from moeserve.server.openapi import NO_PARSER_RULE, at_most_pattern

VOCAB, CONTEXT = 1000, 512


@pytest.mark.parametrize("m", [0, 1, 9, 10, 99, 100, 101, 999, 1000, 49151, 129279])
def test_at_most_pattern_matches_exactly_0_to_m(m):
    pattern = re.compile(at_most_pattern(m))
    around = set(range(0, min(m, 2000) + 50)) | set(range(max(0, m - 2000), m + 2000))
    assert sorted(n for n in around if pattern.match(str(n))) == sorted(
        n for n in around if n <= m)
    assert not pattern.match("01") and not pattern.match("-1") and not pattern.match("")


def document(overrides: list[str], template: str | None = None) -> dict:
    from moeserve.server.api import create_app

    cfg = compose(overrides)
    manager = SimpleNamespace(
        served_model_name="m", model_path="/models/m", vocab_size=VOCAB, max_req_len=CONTEXT,
        max_completion_tokens=min(cfg.server.max_completion_tokens or CONTEXT, CONTEXT - 1),
        tokenizer=SimpleNamespace(chat_template=template), scheduler_info={})
    return create_app(manager, cfg).openapi()


def walk(node):
    if isinstance(node, dict):
        yield node
        for v in node.values():
            yield from walk(v)
    elif isinstance(node, list):
        for v in node:
            yield from walk(v)


def test_limits_are_written_in():
    doc = document(["server.max_n=3", "server.max_completion_tokens=64"])
    text = json.dumps(doc)
    assert '"x-' not in text and '"422"' not in text and "HTTPValidationError" not in text
    schemas = doc["components"]["schemas"]
    ids = [s for s in walk(schemas) if s.get("type") == "integer" and s.get("minimum") == 0
           and "maximum" in s and s["maximum"] == VOCAB - 1]
    assert len(ids) >= 6  # prompt ids (2 shapes), stop_token_ids (3), /generate ids, detokenize
    keys = [s["propertyNames"]["pattern"] for s in walk(schemas) if "propertyNames" in s]
    assert keys and set(keys) == {at_most_pattern(VOCAB - 1)}
    chat = schemas["ChatCompletionRequest"]["properties"]
    assert chat["n"]["maximum"] == 3
    assert [b.get("maximum") for b in chat["max_tokens"]["anyOf"]] == [64, None]
    assert chat["model"]["anyOf"][0]["enum"] == ["m", "/models/m", "unknown", ""]
    assert NO_PARSER_RULE in schemas["ChatCompletionRequest"]["allOf"]  # no tool format: none
    ops = [op for path in doc["paths"].values() for op in path.values()]
    assert len({op["operationId"] for op in ops}) == len(ops)
    assert all("503" in op["responses"] and "401" not in op["responses"] for op in ops)


def test_api_key_and_tool_parser_change_the_document():
    doc = document(["server.api_key=k", "server.tool_parser=hermes"])
    secured = {p for p, ops in doc["paths"].items() for op in ops.values() if op.get("security")}
    assert {"/v1/chat/completions", "/v1/completions", "/generate", "/tokenize"} <= secured
    assert not secured & {"/health", "/metrics", "/model_info", "/server_info"}
    for path in secured:
        for op in doc["paths"][path].values():
            assert op["responses"]["401"]["content"]["application/json"]["schema"]["$ref"] == \
                "#/components/schemas/ErrorResponse"
    assert doc["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    assert NO_PARSER_RULE not in doc["components"]["schemas"]["ChatCompletionRequest"]["allOf"]
