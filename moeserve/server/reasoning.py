"""Reasoning parsers: `<think>…</think>` in the reply → `reasoning_content`, whole or streamed.

- `deepseek_r1`: the reply starts inside the reasoning (R1's template opens `<think>` in the
  prompt), so everything before `</think>` is reasoning, all of it when the tag never comes;
- `qwen3`: reasoning only when the reply opens with `<think>` (with `enable_thinking=false` the
  template closes an empty block in the prompt and the reply is plain content).
"""

from __future__ import annotations

from dataclasses import dataclass

OPEN, CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningStyle:
    name: str
    starts_inside: bool  # the reply begins in reasoning without an opening tag


STYLES = {"deepseek_r1": ReasoningStyle("deepseek_r1", True),
          "qwen3": ReasoningStyle("qwen3", False)}


def _held(text: str, marker: str) -> int:
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class ReasoningParser:
    """`feed(delta)` → (reasoning delta, content delta); `finish()` flushes what was held back.

    States: before (may still open a block), inside (reasoning), after (content). Tag prefixes at
    the end of the text are held until the next delta decides them."""

    def __init__(self, style: ReasoningStyle):
        self.state = "before"
        self.otherwise = "inside" if style.starts_inside else "after"  # when no tag opens it
        self.entered = style.starts_inside  # a reasoning block was seen (or is implied)
        self.buf = ""
        self._lead = False  # newlines right after </think> are dropped

    def feed(self, delta: str) -> tuple[str, str]:
        self.buf += delta
        reasoning = content = ""
        while True:
            if self.state == "before":
                stripped = self.buf.lstrip()
                if stripped.startswith(OPEN):
                    self.state, self.buf = "inside", stripped[len(OPEN):]
                    self.entered = True
                    continue
                if OPEN.startswith(stripped):  # still undecided (empty or a tag prefix)
                    return reasoning, content
                self.state = self.otherwise
            if self.state == "inside":
                i = self.buf.find(CLOSE)
                if i < 0:
                    keep = _held(self.buf, CLOSE)
                    reasoning += self.buf[: len(self.buf) - keep]
                    self.buf = self.buf[len(self.buf) - keep:]
                    return reasoning, content
                reasoning += self.buf[:i]
                self.state, self.buf, self._lead = "after", self.buf[i + len(CLOSE):], True
                continue
            if self._lead:
                self.buf = self.buf.lstrip("\n")
                self._lead = not self.buf
            content, self.buf = content + self.buf, ""
            return reasoning, content

    def finish(self) -> tuple[str, str]:
        rest, self.buf = self.buf, ""
        inside = self.state == "inside" or self.state == "before" and self.otherwise == "inside"
        return (rest, "") if inside else ("", rest)


def split_reasoning(style: ReasoningStyle, text: str) -> tuple[str | None, str]:
    """Whole reply → (reasoning or None, content)."""
    parser = ReasoningParser(style)
    r1, c1 = parser.feed(text)
    r2, c2 = parser.finish()
    return (r1 + r2 if parser.entered else None), c1 + c2
