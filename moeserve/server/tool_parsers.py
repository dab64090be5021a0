"""Tool-call parsers per model family: generated text → (content, tool calls), whole or streamed.

Formats (what the models are trained to emit):
- `hermes` (Qwen2.5/Qwen3, Hermes): `<tool_call>{"name": …, "arguments": {…}}</tool_call>`,
  repeated;
- `deepseek_v3`: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME`, a
  ```json block, `<｜tool▁call▁end｜>`, …, `<｜tool▁calls▁end｜>`; V3.1's
  `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{…}<｜tool▁call▁end｜>` is read too (the markers are
  added tokens that decoding keeps);
- `llama3`: a JSON object `{"name": …, "parameters": {…}}` (optionally after `<|python_tag|>`),
  several separated by `;`, as the whole reply.
A call is kept only when its arguments are a JSON object and its name is one of the offered tools;
text that does not parse stays content (SGLang and vLLM do the same).
"""

from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (OpenAI's format)
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


class ToolParser(ABC):
    name: str

    @abstractmethod
    def start(self, text: str) -> int | None:
        """Index where tool calls begin in `text`, or None."""

    def hold(self, text: str) -> int:
        """How many trailing characters might be the beginning of a start marker (not shown yet)."""
        return 0

    @abstractmethod
    def calls(self, tool_text: str, final: bool) -> list[tuple[str, Any]] | None:
        """(name, arguments) of the complete calls in `tool_text` (from the start marker on); with
        `final`, also a last unterminated one. None: the text is not well-formed tool calls."""

    def format_prompt(self, tools: list[dict[str, Any]]) -> str:
        """A system prompt offering `tools` in this format (for templates that have no tools)."""
        specs = "\n".join(json.dumps(t.get("function", t)) for t in tools)
        return (f"You can call these functions:\n{specs}\nTo call one, reply with "
                f"{self.example}. Otherwise reply normally.")

    example = ""

    def format_calls(self, calls: list[tuple[str, Any]]) -> str:
        """(name, arguments) calls written as a reply in this format (earlier turns of a chat
        whose template cannot render tool calls)."""
        return "".join(f'<tool_call>{json.dumps({"name": n, "arguments": a})}</tool_call>'
                       for n, a in calls)

    def format_result(self, content: str) -> str:
        """A tool's result as the text of a user turn (templates without a tool role)."""
        return f"<tool_response>\n{content}\n</tool_response>"


def _held(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class HermesParser(ToolParser):
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    example = '<tool_call>{"name": NAME, "arguments": {ARGUMENTS}}</tool_call>'

    def start(self, text: str) -> int | None:
        i = text.find(self.OPEN)
        return None if i < 0 else i

    def hold(self, text: str) -> int:
        return _held(text, self.OPEN)

    def calls(self, tool_text: str, final: bool) -> list[tuple[str, Any]] | None:
        out = []
        for block in tool_text.split(self.OPEN)[1:]:
            body, closed, _ = block.partition(self.CLOSE)  # text after a call is dropped
            if not closed and (not final or not body.strip()):
                break
            obj = _json(body)
            if not isinstance(obj, dict) or "name" not in obj:
                return None
            out.append((obj["name"], obj.get("arguments", obj.get("parameters", {}))))
        return out


class DeepSeekV3Parser(ToolParser):
    name = "deepseek_v3"
    BEGIN, END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    CALL, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
    example = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n"
               "{ARGUMENTS}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>")

    def start(self, text: str) -> int | None:
        i = text.find(self.BEGIN)
        return None if i < 0 else i

    def hold(self, text: str) -> int:
        return _held(text, self.BEGIN)

    def format_calls(self, calls: list[tuple[str, Any]]) -> str:
        return self.BEGIN + "".join(
            f"{self.CALL}function{self.SEP}{n}\n```json\n{json.dumps(a)}\n```{self.CALL_END}"
            for n, a in calls) + self.END

    def format_result(self, content: str) -> str:
        return f"<｜tool▁output▁begin｜>{content}<｜tool▁output▁end｜>"

    def calls(self, tool_text: str, final: bool) -> list[tuple[str, Any]] | None:
        body = tool_text[len(self.BEGIN):].split(self.END)[0]
        out = []
        for block in body.split(self.CALL)[1:]:
            call, closed, _ = block.partition(self.CALL_END)
            if not closed and not final:
                break
            head, sep, args = call.partition(self.SEP)
            if not sep:
                return None
            if head.strip() == "function":  # V3: type, then name and a ```json block
                name, _, args = args.partition("\n")
                args = args.strip().removeprefix("```json").removesuffix("```")
            else:  # V3.1: name, then the arguments
                name = head
            obj = _json(args)
            if not isinstance(obj, dict):
                return None
            out.append((name.strip(), obj))
        return out


class Llama3Parser(ToolParser):
    name = "llama3"
    TAG = "<|python_tag|>"
    example = '{"name": NAME, "parameters": {ARGUMENTS}}'

    def start(self, text: str) -> int | None:
        stripped = text.lstrip()
        if stripped.startswith(self.TAG) or stripped.startswith("{"):
            return len(text) - len(stripped)
        return None

    def hold(self, text: str) -> int:
        return len(text) if not text.strip() or self.TAG.startswith(text.lstrip()) else 0

    def format_calls(self, calls: list[tuple[str, Any]]) -> str:
        return "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in calls)

    def format_result(self, content: str) -> str:
        return content

    def calls(self, tool_text: str, final: bool) -> list[tuple[str, Any]] | None:
        text, pos, out = tool_text.strip().removeprefix(self.TAG), 0, []
        decoder = json.JSONDecoder()
        while pos < len(text):
            while pos < len(text) and text[pos] in " \t\n;":
                pos += 1
            if pos == len(text):
                break
            try:
                obj, pos = decoder.raw_decode(text, pos)
            except json.JSONDecodeError:
                return None if final else out
            if not isinstance(obj, dict) or "name" not in obj:
                return None
            out.append((obj["name"], obj.get("parameters", obj.get("arguments", {}))))
        return out


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except (json.JSONDecodeError, TypeError):
        return None


PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser, "deepseek_v3": DeepSeekV3Parser, "llama3": Llama3Parser}


def detect_parser(chat_template: str | None) -> str:
    """The parser a chat template's own tool format asks for ('none' if it has none)."""
    t = chat_template or ""
    if "tool▁calls▁begin" in t:
        return "deepseek_v3"
    if "<tool_call>" in t:
        return "hermes"
    if "<|python_tag|>" in t or "ipython" in t:
        return "llama3"
    return "none"


def make_parser(name: str, chat_template: str | None) -> ToolParser | None:
    name = detect_parser(chat_template) if name == "auto" else name
    return PARSERS[name]() if name in PARSERS else None


def _validated(found: list[tuple[str, Any]] | None, names: set[str]) -> list[ToolCall] | None:
    if found is None or any(n not in names or not isinstance(a, dict) for n, a in found):
        return None
    return [ToolCall(n, json.dumps(a, ensure_ascii=False)) for n, a in found]


def parse_tool_calls(parser: ToolParser, text: str, names: set[str]
                     ) -> tuple[str, list[ToolCall]]:
    """Whole reply → (content before the calls, calls); unparsable calls leave the text as is."""
    i = parser.start(text)
    if i is None:
        return text, []
    calls = _validated(parser.calls(text[i:], final=True), names)
    return (text, []) if not calls else (text[:i], calls)


class StreamingToolParser:
    """Incremental form: `feed(delta)` → (content delta, calls completed by it); `finish()` flushes.

    Content is passed through until a start marker (or what may become one) appears; from there
    the text is buffered and each call is released once complete, in OpenAI's delta format."""

    def __init__(self, parser: ToolParser, names: set[str]):
        self.parser, self.names = parser, names
        self.text = ""  # everything fed
        self.shown = 0  # characters of text released as content
        self.tool_start: int | None = None
        self.emitted: list[ToolCall] = []

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        self.text += delta
        if self.tool_start is None:
            self.tool_start = self.parser.start(self.text)
        if self.tool_start is None:
            end = len(self.text) - self.parser.hold(self.text[self.shown:])
            return self._release(end), []
        content = self._release(self.tool_start)
        found = self.parser.calls(self.text[self.tool_start:], final=False) or []
        new = _validated(found[len(self.emitted):], self.names) or []
        self.emitted += new
        return content, new

    def finish(self) -> tuple[str, list[ToolCall]]:
        """At the end: calls not yet released, or the buffered text as content if the tool section
        did not parse (nothing was emitted from it yet)."""
        if self.tool_start is None:
            return self._release(len(self.text)), []
        found = self.parser.calls(self.text[self.tool_start:], final=True)
        calls = _validated(found, self.names)
        if calls is None and not self.emitted:
            return self._release(len(self.text)), []
        return "", (calls or [])[len(self.emitted):]

    def _release(self, end: int) -> str:
        end = max(end, self.shown)
        out, self.shown = self.text[self.shown:end], end
        return out
