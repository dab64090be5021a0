"""Reasoning parsers: whole and streamed (every split point) give the same reasoning and content."""

from __future__ import annotations

import pytest

from moeserve.server.reasoning import STYLES, ReasoningParser, split_reasoning

CASES = [  # style, reply, reasoning, content
    ("deepseek_r1", "Let me add.\n1+1=2</think>\n\nThe answer is 2.", "Let me add.\n1+1=2",
     "The answer is 2."),
    ("deepseek_r1", "<think>Hmm.</think>Two.", "Hmm.", "Two."),  # R1-0528 repeats the tag
    ("deepseek_r1", "still thinking when cut", "still thinking when cut", ""),
    ("qwen3", "<think>\nadd them\n</think>\n\n2", "\nadd them\n", "2"),
    ("qwen3", "2, no thinking.", None, "2, no thinking."),
    ("qwen3", "  <think>x</think>y", "x", "y"),
    ("qwen3", "a < b", None, "a < b"),
]


@pytest.mark.parametrize("style,reply,reasoning,content", CASES)
def test_whole_and_streamed(style, reply, reasoning, content):
    assert split_reasoning(STYLES[style], reply) == (reasoning, content)
    for cut in range(len(reply) + 1):
        for step in (1, 3):
            p = ReasoningParser(STYLES[style])
            pieces = [reply[:cut]] + [reply[i : i + step] for i in range(cut, len(reply), step)]
            r = c = ""
            for piece in pieces:
                dr, dc = p.feed(piece)
                r, c = r + dr, c + dc
            dr, dc = p.finish()
            assert (r + dr, c + dc) == (reasoning or "", content), (cut, step)
