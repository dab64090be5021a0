"""What a chat reply's text becomes: reasoning_content, content and tool_calls, whole or streamed.

The reasoning parser runs first (a tool call inside `<think>` is only thought about), then the tool
parser on the content. Either is optional; with neither, text passes through unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moeserve.server.reasoning import ReasoningParser, ReasoningStyle, split_reasoning
from moeserve.server.tool_parsers import (StreamingToolParser, ToolCall, ToolParser,
                                          parse_tool_calls)


@dataclass
class ChatParts:
    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)

    def __iadd__(self, other: ChatParts) -> ChatParts:
        self.reasoning += other.reasoning
        self.content += other.content
        self.calls += other.calls
        return self


@dataclass(frozen=True)
class ChatOutputSpec:
    """How one request's replies are split (None parts are off)."""

    reasoning: ReasoningStyle | None = None
    tools: ToolParser | None = None
    tool_names: frozenset[str] = frozenset()
    parallel_tool_calls: bool = True

    def parse(self, text: str) -> tuple[str | None, str, list[ToolCall]]:
        """Whole reply → (reasoning or None, content, calls)."""
        reasoning, content = (None, text) if self.reasoning is None else split_reasoning(
            self.reasoning, text)
        calls: list[ToolCall] = []
        if self.tools is not None:
            content, calls = parse_tool_calls(self.tools, content, set(self.tool_names))
        return reasoning, content, calls if self.parallel_tool_calls else calls[:1]

    def stream(self) -> ChatStream:
        return ChatStream(self)


class ChatStream:
    """Incremental form of ChatOutputSpec.parse for one choice."""

    def __init__(self, spec: ChatOutputSpec):
        self.spec = spec
        self.reasoning = None if spec.reasoning is None else ReasoningParser(spec.reasoning)
        self.tools = None if spec.tools is None else StreamingToolParser(spec.tools,
                                                                         set(spec.tool_names))
        self.num_calls = 0

    def feed(self, delta: str) -> ChatParts:
        reasoning, content = ("", delta) if self.reasoning is None else self.reasoning.feed(delta)
        return self._content(ChatParts(reasoning), content, final=False)

    def finish(self) -> ChatParts:
        reasoning, content = ("", "") if self.reasoning is None else self.reasoning.finish()
        return self._content(ChatParts(reasoning), content, final=True)

    def _content(self, parts: ChatParts, content: str, final: bool) -> ChatParts:
        if self.tools is None:
            parts.content = content
            return parts
        parts.content, parts.calls = self.tools.feed(content)
        if final:
            more, calls = self.tools.finish()
            parts.content += more
            parts.calls += calls
        if not self.spec.parallel_tool_calls:
            parts.calls = parts.calls[: max(0, 1 - self.num_calls)]
        self.num_calls += len(parts.calls)
        return parts
