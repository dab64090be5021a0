"""Chat messages as OpenAI clients send them, made into what a chat template can render.

On the second turn of a tool loop the `openai` SDK sends back the assistant message it received
(`content` null or absent, `tool_calls` whose `arguments` are a JSON string), then one `role:
"tool"` message per call. Templates disagree on what they accept:
- templates with a tool format read `tool_calls`; HF documents `arguments` as an object (a
  `| tojson` template prints a string quoted), DeepSeek's concatenates them as a string; some test
  `content is none`, others concatenate the content as a string;
- templates without one (SmolLM2's, the tiny test models') ignore `tool_calls`, so the call would
  vanish from the prompt, and may drop or mis-render the `tool` role.
So: text parts are joined, `developer` is `system`, a tool result carries its function's name.
Templates that render tool calls get them in the forms HF documents first (objects, missing
content as None), then, if the template raises, the forms OpenAI sends (strings, content "").
Templates that do not get each call written into the assistant's content in the tool parser's
format (the one the system prompt taught the model) and, where the template drops the `tool`
role, each run of tool results as one user turn in that format. What a template renders is probed
once per tokenizer (`TemplateCaps`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from moeserve.server.tool_parsers import HermesParser, ToolParser

_PROBE = "moeserve_template_probe"

Render = Callable[[list[dict[str, Any]]], str]  # messages -> prompt text (raises on a bad chat)
T = TypeVar("T")


def message_dict(m: Any) -> dict[str, Any]:
    """One request message (protocol.ChatMessage) as a plain dict: text parts joined,
    `developer` as `system`, arguments kept as sent; content None only for tool-call turns."""
    content = m.content
    if isinstance(content, list):
        content = "".join(part.text for part in content)
    out: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role}
    out["content"] = content if m.role == "assistant" and m.tool_calls else content or ""
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id or f"call_{i}", "type": "function",
                              "function": {"name": c.function.name,
                                           "arguments": c.function.arguments}}
                             for i, c in enumerate(m.tool_calls)]
    extra = {"name": m.name, "tool_call_id": m.tool_call_id,
             "reasoning_content": m.reasoning_content}
    return out | {k: v for k, v in extra.items() if v is not None}


@dataclass(frozen=True)
class TemplateCaps:
    tool_calls: bool  # renders an assistant turn's tool_calls
    tool_role: bool  # renders `tool` messages


def probe_template(render: Render) -> TemplateCaps:
    """What the template renders, from two throwaway chats carrying a marker."""
    call = {"id": "call_0", "type": "function", "function": {"name": _PROBE, "arguments": {}}}
    calls = [{"role": "user", "content": "q"},
             {"role": "assistant", "content": None, "tool_calls": [call]}]
    result = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
              {"role": "tool", "content": _PROBE, "tool_call_id": "call_0"}]
    return TemplateCaps(_renders_marker(render, calls), _renders_marker(render, result))


def _renders_marker(render: Render, messages: list[dict[str, Any]]) -> bool:
    for variant in structured_variants(messages):
        try:
            return _PROBE in render(variant)
        except Exception:  # NOTE: a template rejecting a form is the point of trying the next
            continue
    return False


def render_first(render: Callable[[list[dict[str, Any]]], T], messages: list[dict[str, Any]],
                 caps: TemplateCaps, parser: ToolParser | None) -> T:
    """`render` of the first form of `messages` the template accepts (see the module docstring);
    when it accepts none, the first form's error is raised."""
    messages = _name_tool_results(messages)
    forms = structured_variants(messages) if caps.tool_calls else iter(
        [_as_text(messages, caps, parser or HermesParser())])
    error: Exception | None = None
    for form in forms:
        try:
            return render(form)
        except Exception as e:  # NOTE: jinja errors on a form: try the next one
            error = error or e
    assert error is not None
    raise error


def structured_variants(messages: list[dict[str, Any]]) -> Iterator[list[dict[str, Any]]]:
    """The messages with (arguments as objects | as strings) x (missing content None | "")."""
    if not any(m.get("tool_calls") for m in messages):
        yield messages
        return
    for as_objects in (True, False):
        for none_content in (True, False):
            yield [_tool_turn(m, as_objects, none_content) if m.get("tool_calls") else m
                   for m in messages]


def _tool_turn(m: dict[str, Any], as_objects: bool, none_content: bool) -> dict[str, Any]:
    calls = [c | {"function": c["function"] | {"arguments": _arguments(
        c["function"]["arguments"], as_objects)}} for c in m["tool_calls"]]
    content = m.get("content")
    return m | {"tool_calls": calls, "content": content if content or none_content else ""}


def _arguments(args: Any, as_object: bool) -> Any:
    if as_object and isinstance(args, str):
        try:
            parsed = json.loads(args)
        except json.JSONDecodeError:
            return args
        return parsed if isinstance(parsed, dict) else args
    if not as_object and not isinstance(args, str):
        return json.dumps(args, ensure_ascii=False)
    return args


def _name_tool_results(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tool results get the `name` of the call they answer (templates that print it)."""
    names = {c["id"]: c["function"]["name"] for m in messages for c in m.get("tool_calls") or ()}
    return [m | {"name": names[m["tool_call_id"]]} if m["role"] == "tool" and "name" not in m
            and m.get("tool_call_id") in names else m for m in messages]


def _as_text(messages: list[dict[str, Any]], caps: TemplateCaps,
             parser: ToolParser) -> list[dict[str, Any]]:
    """Tool calls and (where the template drops them) tool results as plain text turns."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m.get("tool_calls"):
            calls = [(c["function"]["name"], _arguments(c["function"]["arguments"], True))
                     for c in m["tool_calls"]]
            text = (m.get("content") or "") + parser.format_calls(calls)
            m = {k: v for k, v in m.items() if k != "tool_calls"} | {"content": text}
        elif m["role"] == "tool" and not caps.tool_role:
            result = parser.format_result(m.get("content") or "")
            if out and out[-1].get("from_tools"):  # one user turn per run of results
                out[-1] = out[-1] | {"content": f"{out[-1]['content']}\n{result}"}
                continue
            m = {"role": "user", "content": result, "from_tools": True}
        out.append(m)
    return [{k: v for k, v in m.items() if k != "from_tools"} for m in out]
