"""The `openai` SDK's two-turn tool loop renders through every chat template we test with.

The SDK itself builds the second turn (through an httpx mock transport, no server): the assistant
message it parsed from the first reply (`content` null, `tool_calls` with JSON-string arguments),
appended as users do, then a `tool` result, plus a developer message and multi-part content. The
captured request is validated and normalised as the server does (chat_messages.py) and rendered
with: SmolLM2's template and the tiny models' (no tool format: the call is written in the parser's
format), and two templates written here with a tool format, one printing arguments with `tojson`
(HF's documented form, objects) and one concatenating them (DeepSeek's form, strings)."""

from __future__ import annotations

import json

import httpx
import pytest

from moeserve.server.chat_messages import message_dict, probe_template, render_first
from moeserve.server.protocol import ChatCompletionRequest
from moeserve.server.tool_parsers import HermesParser

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
FIRST_REPLY = {  # what the server answers a tool call with
    "id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "m",
    "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": None, "tool_calls": [{
            "id": "call_7", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}}]}

TOOLS_TEMPLATE = (  # ChatML with a tool format: arguments printed as JSON (objects expected)
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n"
    "{%- if message.content %}{{ message.content }}{% endif %}"
    "{%- for call in message.tool_calls %}<tool_call>{\"name\": \"{{ call.function.name }}\", "
    "\"arguments\": {{ call.function.arguments | tojson }}}</tool_call>{% endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>{{ message.content }}"
    "</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CONCAT_TEMPLATE = (  # DeepSeek-like: `content is none` tested, arguments concatenated (strings)
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' and message['tool_calls'] %}<｜Assistant｜>"
    "{%- if message['content'] is not none %}{{ message['content'] }}{% endif %}"
    "{%- for call in message['tool_calls'] %}<｜tool▁call▁begin｜>"
    "{{ call['function']['name'] + '\n' + call['function']['arguments'] }}<｜tool▁call▁end｜>"
    "{%- endfor %}<｜end▁of▁sentence｜>"
    "{%- elif message['role'] == 'tool' %}<｜tool▁output▁begin｜>{{ message['content'] }}"
    "<｜tool▁output▁end｜>"
    "{%- else %}{{ '<｜' + message['role'] + '｜>' + message['content'] }}{% endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<｜Assistant｜>{% endif %}")


@pytest.fixture(scope="module")
def sdk_second_turn() -> dict:
    """The JSON body the official SDK sends for the loop's second turn."""
    import openai

    sent: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        return httpx.Response(200, json=FIRST_REPLY)

    client = openai.OpenAI(api_key="k", base_url="http://sdk.test/v1", max_retries=0,
                           http_client=httpx.Client(transport=httpx.MockTransport(handler)))
    messages: list = [{"role": "developer", "content": "Be brief."},
                      {"role": "user", "content": [{"type": "text", "text": "Weather in "},
                                                   {"type": "text", "text": "Paris?"}]}]
    reply = client.chat.completions.create(model="m", messages=messages, tools=[WEATHER])
    messages.append(reply.choices[0].message)  # as the SDK's documentation shows
    for call in reply.choices[0].message.tool_calls:
        messages.append({"role": "tool", "tool_call_id": call.id, "content": "21 C, sunny"})
    client.chat.completions.create(model="m", messages=messages, tools=[WEATHER])
    return sent[-1]


@pytest.fixture(scope="module")
def tokenizers():
    from transformers import AutoTokenizer

    from moeserve.models.embedded import embedded_model_path
    from moeserve.tools.make_tiny import load_tokenizer

    return {"smollm2": AutoTokenizer.from_pretrained(embedded_model_path()),
            "tiny": load_tokenizer()}


CASES = {"smollm2": ("smollm2", None), "tiny": ("tiny", None),
         "tools-tojson": ("smollm2", TOOLS_TEMPLATE), "tools-concat": ("tiny", CONCAT_TEMPLATE)}


def render_with(tokenizer, template: str | None):
    def render(messages: list[dict]) -> str:
        return tokenizer.apply_chat_template(messages, tokenize=False, chat_template=template,
                                             add_generation_prompt=True)
    return render


def test_the_sdk_sends_what_templates_trip_on(sdk_second_turn):
    """The request really has the shapes at issue: null content with string arguments."""
    assistant = next(m for m in sdk_second_turn["messages"] if m["role"] == "assistant")
    assert assistant["content"] is None
    assert isinstance(assistant["tool_calls"][0]["function"]["arguments"], str)
    assert isinstance(sdk_second_turn["messages"][1]["content"], list)


@pytest.mark.parametrize("case", list(CASES))
def test_second_turn_renders_through_the_template(sdk_second_turn, tokenizers, case):
    name, template = CASES[case]
    render = render_with(tokenizers[name], template)
    req = ChatCompletionRequest.model_validate(sdk_second_turn)
    messages = [message_dict(m) for m in req.messages]
    text = render_first(render, messages, probe_template(render), HermesParser())
    assert "Be brief." in text and "Weather in Paris?" in text
    call, result = text.index("get_weather"), text.index("21 C, sunny")
    assert call < result < text.rindex("assistant" if name == "smollm2" else "Assistant")
    assert "Paris" in text[call:result]
    if case in ("smollm2", "tools-tojson"):  # the arguments are a JSON object, not a string
        assert '"arguments": {"city": "Paris"}' in text
    if case == "tools-concat":
        assert 'get_weather\n{"city": "Paris"}' in text


@pytest.mark.parametrize("case", ["smollm2", "tools-tojson"])
def test_raw_sdk_messages_break_these_templates(sdk_second_turn, tokenizers, case):
    """Without the normalisation (text parts joined, nothing else) the same turn fails, or prints
    the arguments as a quoted string: what the test above guards."""
    name, template = CASES[case]
    raw = [m | {"content": "".join(p["text"] for p in m["content"])}
           if isinstance(m.get("content"), list) else m for m in sdk_second_turn["messages"]]
    try:
        text = render_with(tokenizers[name], template)(raw)
    except Exception as e:  # SmolLM2's: "'dict object' has no attribute 'content'" (issue 45)
        assert case == "smollm2" and "content" in str(e)
        return
    assert '"arguments": {"city": "Paris"}' not in text and '\\"city\\"' in text


def test_template_capabilities_are_probed(tokenizers):
    caps = {case: probe_template(render_with(tokenizers[n], t)) for case, (n, t) in CASES.items()}
    assert caps["smollm2"].tool_calls is False and caps["smollm2"].tool_role is True
    assert caps["tiny"].tool_calls is False and caps["tiny"].tool_role is False
    assert caps["tools-tojson"].tool_calls and caps["tools-concat"].tool_calls
