"""Issue 18 through the official `openai` client on one live server (embedded SmolLM2, float32):
penalties and logit_bias against transformers' greedy generation with its logits processors; tool
calls and reasoning content, whole and streamed (SmolLM2 has no tool or thinking format of its own:
a few-shot turn shows it the Hermes and `<think>` forms, which greedy decoding then follows)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MODEL = "smollm2-135m-instruct"
POEM = [{"role": "user", "content": "Write a short poem about the sea."}]
N = 16


@pytest.fixture(scope="module")
def server(smollm2_tools_server):
    """shared_servers.SMOLLM2_TOOLS_ARGS: float32, Hermes tools, qwen3 reasoning (shared)."""
    return smollm2_tools_server


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(api_key="unused", base_url=server.url + "/v1", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from moeserve.models.embedded import embedded_model_path

    path = embedded_model_path()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path)


class OpenAIPenalties:
    """OpenAI's documented arithmetic over the generated tokens (a transformers LogitsProcessor)."""

    def __init__(self, prompt_len: int, frequency: float, presence: float):
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        counts = torch.zeros_like(scores)
        gen = input_ids[:, self.prompt_len :]
        counts.scatter_add_(1, gen, torch.ones_like(gen, dtype=scores.dtype))
        return scores - counts * self.frequency - (counts > 0).to(scores.dtype) * self.presence


def greedy_under(hf, prompt: list[int], out: list[int], processors) -> bool:
    """Teacher-forced oracle: each served token is the argmax of transformers' logits after the
    processors, given everything before it (one forward instead of a generate loop)."""
    model, _ = hf
    full = torch.tensor(prompt + out)[None]
    with torch.no_grad():
        logits = model(full).logits[0, len(prompt) - 1 : -1]  # [N, V]
    for t, tok in enumerate(out):
        scores = logits[t : t + 1].clone()
        for proc in processors(len(prompt)):
            scores = proc(full[:, : len(prompt) + t], scores)
        if int(scores.argmax()) != tok:
            return False
    return True


def test_penalties_and_bias_match_transformers(client, server, hf):
    import httpx
    from transformers.generation.logits_process import (RepetitionPenaltyLogitsProcessor,
                                                        SequenceBiasLogitsProcessor)

    model, tok = hf
    prompt = tok.apply_chat_template(POEM, add_generation_prompt=True, tokenize=True,
                                     return_dict=True)["input_ids"]

    def native(params: dict) -> list[int]:
        body = {"input_ids": prompt, "sampling_params": {
            "max_new_tokens": N, "temperature": 0, "ignore_eos": True, **params}}
        return httpx.post(server.url + "/generate", json=body, timeout=120).json()["output_ids"]

    plain = native({})
    banned = plain[0]
    cases = [  # OpenAI request fields, /generate sampling_params, transformers processors
        ({"extra_body": {"repetition_penalty": 1.3}}, {"repetition_penalty": 1.3},
         lambda n: [RepetitionPenaltyLogitsProcessor(1.3)]),
        ({"frequency_penalty": 1.5, "presence_penalty": 0.5},
         {"frequency_penalty": 1.5, "presence_penalty": 0.5},
         lambda n: [OpenAIPenalties(n, 1.5, 0.5)]),
        ({"logit_bias": {str(banned): -100}, "presence_penalty": 1.0},
         {"logit_bias": {str(banned): -100}, "presence_penalty": 1.0},
         lambda n: [OpenAIPenalties(n, 0.0, 1.0),
                    SequenceBiasLogitsProcessor({(banned,): -100.0})]),
    ]
    for kw, params, processors in cases:
        ids = native(params)
        assert ids != plain and greedy_under(hf, prompt, ids, processors), params
        extra = kw.pop("extra_body", {})
        out = client.chat.completions.create(
            model=MODEL, messages=POEM, max_tokens=N, temperature=0,
            extra_body={"ignore_eos": True, **extra}, **kw)
        assert out.choices[0].message.content == tok.decode(ids, skip_special_tokens=True)
    assert not greedy_under(hf, prompt, native(cases[0][1]), lambda n: [])  # the oracle bites


def test_penalty_errors_name_the_parameter(client):
    import openai

    for kw, name in [({"frequency_penalty": 3.0}, "frequency_penalty"),
                     ({"logit_bias": {"999999": 5}}, "logit_bias"),
                     ({"logit_bias": {"x": 5}}, "logit_bias"),
                     ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=POEM, max_tokens=2, **kw)
        assert name in str(e.value)


def test_streamed_top_logprobs(client):
    stream = client.chat.completions.create(model=MODEL, messages=POEM, max_tokens=4,
                                            temperature=0, logprobs=True, top_logprobs=3,
                                            stream=True)
    entries = [t for c in stream if c.choices and c.choices[0].logprobs
               for t in c.choices[0].logprobs.content or []]
    assert len(entries) == 4 and all(len(t.top_logprobs) == 3 for t in entries)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
SHOT = '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
TOOL_CHAT = [{"role": "user", "content": "Weather in Rome?"},
             {"role": "assistant", "content": SHOT},
             {"role": "tool", "content": "21 C, sunny", "tool_call_id": "call_1"},
             {"role": "assistant", "content": "It is 21 C and sunny in Rome."},
             {"role": "user", "content": "Weather in Paris?"}]


@pytest.mark.parametrize("choice", ["auto", "required", "named"])
def test_tool_calls_whole_and_streamed(client, choice):
    import json

    tool_choice = {"type": "function", "function": {"name": "get_weather"}} \
        if choice == "named" else choice
    kw = dict(model=MODEL, messages=TOOL_CHAT, tools=[WEATHER, TIME], tool_choice=tool_choice,
              temperature=0, max_tokens=40)
    out = client.chat.completions.create(**kw).choices[0]
    assert out.finish_reason == "tool_calls" and out.message.content is None
    (call,) = out.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    chunks = list(client.chat.completions.create(stream=True, **kw))
    deltas = [c.choices[0].delta.tool_calls for c in chunks if c.choices[0].delta.tool_calls]
    assert [(d[0].index, d[0].function.name, d[0].function.arguments) for d in deltas] == [
        (0, "get_weather", call.function.arguments)]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not any(c.choices[0].delta.content for c in chunks)


def test_tool_choice_none_and_bad_choices(client):
    import openai

    out = client.chat.completions.create(model=MODEL, messages=TOOL_CHAT, tools=[WEATHER],
                                         tool_choice="none", temperature=0, max_tokens=40)
    assert out.choices[0].message.tool_calls is None  # not parsed: the text stays content
    assert "<tool_call>" in out.choices[0].message.content
    for kw in [{"tools": [WEATHER], "tool_choice": {"type": "function",
                                                     "function": {"name": "nope"}}},
               {"tool_choice": "required"},
               {"tools": [{"type": "function", "function": {"description": "no name"}}]}]:
        named = isinstance(kw.get("tool_choice"), dict)  # a function that does not exist: 404
        with pytest.raises(openai.NotFoundError if named else openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=PARIS_MSG, max_tokens=2, **kw)
        assert "tool" in str(e.value)


PARIS_MSG = [{"role": "user", "content": "What is the capital of France?"}]
THINK_CHAT = [{"role": "user", "content": "What is 2+2?"},
              {"role": "assistant", "content": "<think>2+2 is 4.</think>4"},
              {"role": "user", "content": "What is 3+3?"}]


def test_reasoning_content_whole_and_streamed(client):
    kw = dict(model=MODEL, messages=THINK_CHAT, temperature=0, max_tokens=30)
    msg = client.chat.completions.create(**kw).choices[0].message
    reasoning = msg.model_extra["reasoning_content"]
    assert reasoning and "<think>" not in msg.content and "</think>" not in msg.content
    chunks = [c.choices[0].delta for c in client.chat.completions.create(stream=True, **kw)]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in chunks) == reasoning
    assert "".join(d.content or "" for d in chunks) == msg.content
    raw = client.chat.completions.create(extra_body={"separate_reasoning": False}, **kw)
    assert raw.choices[0].message.content.startswith("<think>")
