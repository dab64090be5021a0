"""Structured outputs (issue 18) through the official `openai` client on one live server (embedded
SmolLM2): json_schema outputs validate with `jsonschema`, json_object parses, regex/ebnf extras
hold on the completions and native routes, and an invalid schema is a 400 naming the problem;
tool_choice required and named are constrained by the tools' schemas (no tool parser needed)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from shared_servers import SMOLLM2_KEY  # noqa: E402

from moeserve.bench.grammar_schemas import hand_written, schemas  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MODEL = "smollm2-135m-instruct"
AUTH = {"Authorization": f"Bearer {SMOLLM2_KEY}"}


def _ask(schema: dict) -> list[dict]:
    return [{"role": "user", "content": "Reply with only a JSON object that matches this JSON "
             f"schema, and nothing else:\n{json.dumps(schema)}"}]


def _fmt(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def _valid(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


@pytest.fixture(scope="module")
def server(smollm2_limits_server):
    """Shared with test_bad_input.py (shared_servers.SMOLLM2_LIMITS_ARGS): SmolLM2 in its default
    dtype, no tool parser; its context (1024) and API key do not matter here."""
    return smollm2_limits_server


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(api_key=SMOLLM2_KEY, base_url=server.url + "/v1", timeout=120,
                         max_retries=0)


def _create_all(client, requests: list[dict]) -> list:
    """All requests in flight at once (the server batches them), results in order."""
    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(lambda kw: client.chat.completions.create(**kw).choices[0],
                             requests))


def test_json_schema_outputs_validate(client):
    """20 schemas (the hand-written 5 and 15 generated): 20/20 valid with json_schema; fewer
    without it for the same prompts of the hand-written 5 (SmolLM2 rarely manages it on its own;
    the contrast needs no more prompts, and unconstrained replies run to max_tokens)."""
    specs = schemas()
    kw = [dict(model=MODEL, messages=_ask(s), temperature=0, max_tokens=300) for s in specs]
    constrained = _create_all(client, [k | {"response_format": _fmt(s)}
                                       for k, s in zip(kw, specs)])
    for out, schema in zip(constrained, specs):
        assert out.finish_reason == "stop", out.message.content
        jsonschema.validate(json.loads(out.message.content), schema)
    few = hand_written()
    free = _create_all(client, kw[: len(few)])
    assert [json.dumps(s) for s in few] == [json.dumps(s) for s in specs[: len(few)]]
    unconstrained = sum(_valid(o.message.content, s) for o, s in zip(free, few))
    print(f"\nvalid JSON for the schema: {len(specs)}/{len(specs)} with json_schema, "
          f"{unconstrained}/{len(few)} unconstrained")
    assert unconstrained < len(few)


def test_json_schema_n_and_streaming(client):
    schema = hand_written()[4]
    kw = dict(model=MODEL, messages=_ask(schema), response_format=_fmt(schema), max_tokens=160,
              temperature=0.8, seed=7, n=3)
    for c in client.chat.completions.create(**kw).choices:
        jsonschema.validate(json.loads(c.message.content), schema)
    texts = ["", "", ""]
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    for text in texts:
        jsonschema.validate(json.loads(text), schema)


def test_json_object_parses(client):
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": 'Reply with only a short JSON object '
                                       'like {"name": "Tom", "age": 3} for a cat.'}],
        response_format={"type": "json_object"}, temperature=0, max_tokens=200).choices[0]
    assert out.finish_reason == "stop"
    assert isinstance(json.loads(out.message.content), dict)


def test_completions_json_schema_and_regex(client):
    schema = hand_written()[1]
    out = client.completions.create(model=MODEL, prompt="A T-shirt as JSON: ", max_tokens=60,
                                    temperature=0, extra_body={"response_format": _fmt(schema)})
    jsonschema.validate(json.loads(out.choices[0].text), schema)
    out = client.completions.create(model=MODEL, prompt="Is the sky blue? Answer: ", max_tokens=10,
                                    temperature=0, extra_body={"regex": "(yes|no), [a-z]{2,8}"})
    assert out.choices[0].finish_reason == "stop"
    assert __import__("re").fullmatch("(yes|no), [a-z]{2,8}", out.choices[0].text)


def test_native_generate_ebnf(server):
    import httpx

    grammar = 'root ::= ("cat" | "dog") " " [0-9]'
    r = httpx.post(server.url + "/generate", json={"text": "My pet: ", "sampling_params": {
        "ebnf": grammar, "temperature": 0, "max_new_tokens": 10}}, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    assert __import__("re").fullmatch("(cat|dog) [0-9]", r.json()["text"])


def test_invalid_schema_is_400(client):
    import openai

    bad = [({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}},
            "bogus"), ({"type": "json_schema", "json_schema": {"name": "x"}}, "schema"),
           ({"type": "xml"}, "xml")]
    for fmt, word in bad:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=_ask({}), response_format=fmt,
                                           max_tokens=5)
        err = e.value.body  # param: the field's path, e.g. response_format.json_schema...
        assert word in err["message"] and err["param"].startswith("response_format"), err


def _tools() -> list[dict]:
    """Three tools: a nested object, enums, bounded integers, required and optional fields."""
    s = lambda n: {"type": "string", "maxLength": n}  # noqa: E731
    fn = lambda name, props, req: {"type": "function", "function": {  # noqa: E731
        "name": name, "parameters": {"type": "object", "properties": props, "required": req}}}
    date = {"type": "object", "required": ["month", "day"], "properties": {
        "month": {"type": "integer", "minimum": 1, "maximum": 12},
        "day": {"type": "integer", "minimum": 1, "maximum": 31}}}
    return [fn("book_flight", {"origin": s(16), "destination": s(16), "date": date,
                               "passengers": {"type": "integer", "minimum": 1, "maximum": 9},
                               "cabin": {"enum": ["economy", "business", "first"]}},
               ["origin", "destination", "date", "passengers", "cabin"]),
            fn("get_weather", {"city": s(20), "unit": {"enum": ["celsius", "fahrenheit"]}},
               ["city", "unit"]),
            fn("set_timer", {"minutes": {"type": "integer", "minimum": 1, "maximum": 120},
                             "label": s(20)}, ["minutes"])]


FLIGHT_ASK = [{"role": "user", "content": "Book a flight from Paris to Rome for 2 people in "
               "business class on May 3."}]


@pytest.mark.parametrize("choice", ["named", "required"])
def test_forced_tool_calls_validate(client, choice):
    """tool_choice named / required (parallel_tool_calls false) on a server without a tool parser:
    the grammar ends the reply, and each call's arguments validate, whole and streamed alike."""
    tools = _tools()
    params = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    tool_choice = {"type": "function", "function": {"name": "book_flight"}} \
        if choice == "named" else "required"
    kw = dict(model=MODEL, messages=FLIGHT_ASK, tools=tools, tool_choice=tool_choice,
              parallel_tool_calls=choice == "named", temperature=0, max_tokens=120)
    out = client.chat.completions.create(**kw).choices[0]
    assert out.finish_reason == "tool_calls" and out.message.content is None
    (call,) = out.message.tool_calls  # exactly one: named, or required without parallel calls
    assert call.id.startswith("call_") and (choice == "required" or call.function.name ==
                                            "book_flight")
    jsonschema.validate(json.loads(call.function.arguments), params[call.function.name])
    chunks = list(client.chat.completions.create(stream=True, **kw))
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    assert [(d.index, d.function.name, d.function.arguments) for d in deltas] == [
        (0, call.function.name, call.function.arguments)]  # one chunk per call, whole
    assert deltas[0].id.startswith("call_") and deltas[0].type == "function"
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not any(c.choices[0].delta.content for c in chunks)


def test_forced_tool_choice_errors(client):
    import openai

    named = {"type": "function", "function": {"name": "get_weather"}}
    bogus = {"type": "function", "function": {"name": "broken", "parameters": {"type": "bogus"}}}
    cases = [({"tool_choice": "required", "response_format": {"type": "json_object"}},
              "response_format", "response_format"),
             ({"tool_choice": named, "extra_body": {"regex": "a+"}}, "regex", "regex"),
             ({"tool_choice": {"type": "function", "function": {"name": "nope"}}},
              "tool_choice", "'nope'"),
             ({"tool_choice": "required", "tools": _tools() + [bogus]}, "tools", "'broken'")]
    for kw, param, word in cases:
        # a named function that is not among the tools does not exist: 404, as a model's name
        error = openai.NotFoundError if word == "'nope'" else openai.BadRequestError
        with pytest.raises(error) as e:
            client.chat.completions.create(**{"model": MODEL, "messages": FLIGHT_ASK,
                                              "tools": _tools(), "max_tokens": 5, **kw})
        err = e.value.body
        assert err["param"] == param and word in err["message"], err
