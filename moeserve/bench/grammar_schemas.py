"""The JSON schemas structured outputs are tested and measured on (tests/e2e/test_structured_outputs
and bench.grammar_mask), and one valid instance of each.

`schemas()`: the hand-written 5 (nested objects, enums, bounded arrays, required fields, bounded
numbers and a pattern) followed by `generated(15)`, random object schemas built from the same parts.
"""

from __future__ import annotations

import random
from typing import Any

# a value for each `pattern` used below (instance() cannot invent one for a regex)
PATTERN_EXAMPLES = {"^[A-Z]{3}[0-9]{2}$": "QRS42"}
_TEXT = "the quick brown fox jumps over the lazy dog"


def hand_written() -> list[dict]:
    """Nested objects, enums, bounded arrays, required fields, bounded numbers and patterns."""
    s = lambda n: {"type": "string", "maxLength": n}  # noqa: E731
    obj = lambda props, req=None: {"type": "object", "properties": props,  # noqa: E731
                                   "required": list(props) if req is None else req}
    return [
        obj({"name": s(20), "address": obj({"city": s(20), "zip": {
            "type": "integer", "minimum": 0, "maximum": 99999}})}),
        obj({"color": {"enum": ["red", "green", "blue"]},
             "size": {"type": "string", "enum": ["S", "M", "L"]}}),
        obj({"tags": {"type": "array", "items": s(12), "minItems": 2, "maxItems": 4}}),
        obj({"id": {"type": "integer", "minimum": 1, "maximum": 1000},
             "active": {"type": "boolean"}, "note": s(30)}, req=["id", "active"]),
        obj({"items": {"type": "array", "minItems": 1, "maxItems": 3, "items": obj({
            "sku": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"},
            "qty": {"type": "integer", "minimum": 1, "maximum": 9}})}}),
    ]


def generated(n: int, seed: int = 0) -> list[dict]:
    """n random object schemas built from the same parts (strings with a length bound, bounded
    integers, enums, booleans, bounded arrays, one nested object), a random required subset."""
    rng = random.Random(seed)
    words = ["red", "blue", "north", "south", "small", "large", "open", "closed", "cat", "dog"]

    def leaf() -> dict:
        kind = rng.choice(["string", "integer", "enum", "boolean", "array"])
        if kind == "string":
            return {"type": "string", "maxLength": rng.randrange(4, 13)}
        if kind == "integer":
            lo = rng.randrange(-50, 50)
            return {"type": "integer", "minimum": lo, "maximum": lo + rng.randrange(1, 500)}
        if kind == "enum":
            return {"enum": rng.sample(words, rng.randrange(2, 5))}
        if kind == "boolean":
            return {"type": "boolean"}
        lo = rng.randrange(0, 3)
        return {"type": "array", "items": {"type": "string", "maxLength": 8},
                "minItems": lo, "maxItems": lo + rng.randrange(1, 3)}

    def obj(props: dict) -> dict:
        required = rng.sample(sorted(props), rng.randrange(1, len(props) + 1))
        return {"type": "object", "properties": props, "required": required}

    out = []
    for _ in range(n):
        names = rng.sample(["name", "kind", "count", "tags", "ok", "place", "level", "note"],
                           rng.randrange(2, 5))
        props = {k: leaf() for k in names}
        if rng.random() < 0.5:
            props["detail"] = obj({k: leaf() for k in rng.sample(["a", "b", "c"], 2)})
        out.append(obj(props))
    return out


def schemas() -> list[dict]:
    """The 20 schemas: hand_written() + generated(15)."""
    return hand_written() + generated(15)


def instance(schema: dict, salt: int = 0) -> Any:
    """A valid instance of `schema` (the parts above only): every property present, in order,
    strings filled to about their bound with words, integers inside their range."""
    if "enum" in schema:
        return schema["enum"][salt % len(schema["enum"])]
    kind = schema["type"]
    if kind == "object":
        return {k: instance(v, salt + i) for i, (k, v) in enumerate(schema["properties"].items())}
    if kind == "array":
        n = max(schema.get("minItems", 0), min(2, schema.get("maxItems", 2)))
        return [instance(schema["items"], salt + i) for i in range(n)]
    if kind == "string":
        if "pattern" in schema:
            return PATTERN_EXAMPLES[schema["pattern"]]
        start = (7 * salt) % 20
        return _TEXT[start:start + schema.get("maxLength", 12)].strip()
    if kind == "integer":
        lo, hi = schema.get("minimum", 0), schema.get("maximum", 1000)
        return lo + (hi - lo) * (salt % 3 + 1) // 4
    if kind == "boolean":
        return salt % 2 == 0
    raise ValueError(f"instance() does not know {schema!r}")
