"""Bad requests get a 4xx with OpenAI's error body and leave the server healthy; so do clients that
disconnect mid-request (their requests are aborted and nothing keeps running)."""

from __future__ import annotations

import time

import pytest
from shared_servers import SMOLLM2_CONTEXT, SMOLLM2_KEY

import httpx

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

KEY, CONTEXT = SMOLLM2_KEY, SMOLLM2_CONTEXT
AUTH = {"Authorization": f"Bearer {KEY}"}
MSG = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server(smollm2_limits_server):
    """Shared with test_structured_outputs.py (shared_servers.SMOLLM2_LIMITS_ARGS): SmolLM2, its
    context cut to CONTEXT tokens, an API key, no tool parser."""
    return smollm2_limits_server


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as c:
        yield c


@pytest.fixture(autouse=True)
def stays_healthy(http):
    yield
    assert http.get("/health").status_code == 200


def assert_error(resp, status: int | tuple[int, ...] = 400, code: str | None = None) -> dict:
    statuses = status if isinstance(status, tuple) else (status,)
    assert resp.status_code in statuses, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code is not None:
        assert err["code"] == code
    return err


BAD_CHAT_BODIES = {
    "missing messages": {"model": "x"},
    "messages not a list": {"messages": "hello"},
    "message without role": {"messages": [{"content": "hi"}]},
    "unknown role": {"messages": [{"role": "wizard", "content": "hi"}]},
    "max_tokens wrong type": {"messages": MSG, "max_tokens": "ten"},
    "temperature wrong type": {"messages": MSG, "temperature": "hot"},
    "stop wrong type": {"messages": MSG, "stop": 5},
    "negative max_tokens": {"messages": MSG, "max_tokens": -5},
    "zero max_tokens": {"messages": MSG, "max_tokens": 0},
    "huge max_tokens": {"messages": MSG, "max_tokens": 10**12},
    "n too large": {"messages": MSG, "n": 1000},
    "n zero": {"messages": MSG, "n": 0},
    "negative temperature": {"messages": MSG, "temperature": -1},
    "top_p out of range": {"messages": MSG, "top_p": 1.5},
    "presence_penalty out of range": {"messages": MSG, "presence_penalty": 2.5},
    "frequency_penalty out of range": {"messages": MSG, "frequency_penalty": -3.0},
    "repetition_penalty zero": {"messages": MSG, "repetition_penalty": 0},
    "logit_bias key not a token id": {"messages": MSG, "logit_bias": {"hello": 1}},
    "logit_bias out of range": {"messages": MSG, "logit_bias": {"5": 500}},
    "tool without a function": {"messages": MSG, "tools": [{"type": "function"}]},
    "tool_choice without tools": {"messages": MSG, "tool_choice": "required"},
    "tools without a parser": {"messages": MSG, "tools": [
        {"type": "function", "function": {"name": "f"}}]},
    "bad chat_template_kwargs": {"messages": MSG, "chat_template_kwargs": {"tokenize": 5}},
    "top_logprobs too many": {"messages": MSG, "logprobs": True, "top_logprobs": 1000},
    "body is a list": [1, 2, 3],
}


@pytest.mark.parametrize("name", list(BAD_CHAT_BODIES))
def test_bad_chat_bodies(http, name):
    assert_error(http.post("/v1/chat/completions", json=BAD_CHAT_BODIES[name]))


@pytest.mark.parametrize("body", [b"{not json", b"", b"\xff\xfe", b'{"prompt": "a",}'])
def test_invalid_json(http, body):
    headers = {"Content-Type": "application/json"}
    assert_error(http.post("/v1/completions", content=body, headers=headers))


@pytest.mark.parametrize("body", [{}, {"prompt": []}, {"prompt": [[]]}, {"prompt": 5},
                                  {"prompt": [10**9]}, {"prompt": "x", "logprobs": -1},
                                  {"prompt": "x", "logprobs": 21}, {"prompt": ""},
                                  {"prompt": "x", "best_of": 2}, {"prompt": "x", "suffix": "y"},
                                  {"prompt": "x", "max_tokens": "3"}, {"prompt": "x", "n": 1.5}])
def test_bad_completion_bodies(http, body):
    assert_error(http.post("/v1/completions", json=body))


def test_prompt_longer_than_context(http):
    long_text = "word " * (CONTEXT + 100)  # > CONTEXT tokens
    err = assert_error(http.post("/v1/completions", json={"prompt": long_text, "max_tokens": 4}),
                       code="context_length_exceeded")
    assert str(CONTEXT) in err["message"]
    assert_error(http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": long_text}]}), code="context_length_exceeded")
    assert_error(http.post("/generate", json={"text": long_text}))


def test_prompt_plus_max_tokens_over_context(http):
    assert_error(http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": CONTEXT}),
                 code="context_length_exceeded")


def test_unknown_model_is_404(http, server):
    import openai

    assert_error(http.post("/v1/chat/completions", json={"model": "gpt-9", "messages": MSG}),
                 404, code="model_not_found")
    client = openai.OpenAI(api_key=KEY, base_url=server.url + "/v1", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=MSG)


def test_api_key(http, server):
    import openai

    body = {"messages": MSG, "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        resp = httpx.post(server.url + "/v1/chat/completions", json=body, headers=headers)
        assert_error(resp, 401, code="invalid_api_key")
    assert_error(httpx.get(server.url + "/v1/models"), 401)
    assert_error(httpx.post(server.url + "/generate", json={"text": "a"}), 401)
    bad = openai.OpenAI(api_key="sk-wrong", base_url=server.url + "/v1", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    good = openai.OpenAI(api_key=KEY, base_url=server.url + "/v1", max_retries=0)
    assert good.chat.completions.create(model=good.models.list().data[0].id, messages=MSG,
                                        max_tokens=2).choices[0].message.content is not None


def test_openai_client_raises_bad_request(server):
    import openai

    client = openai.OpenAI(api_key=KEY, base_url=server.url + "/v1", max_retries=0)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="", messages=MSG, max_tokens=-1)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="", prompt="x", presence_penalty=3.0)


def test_unknown_route_and_method(http):
    assert_error(http.get("/v1/nothing"), 404)
    assert_error(http.get("/v1/chat/completions"), 405)


def busy(info: dict) -> int:
    """Requests in flight anywhere, plus KV slots still held (0 when idle: the prefix cache's
    unlocked nodes do not count)."""
    load = info["load"]
    ranks = sum(r.get("running", 0) + r.get("waiting", 0) for r in info["ranks"])
    return info["inflight"] + ranks + load["running"] + load["waiting"] + load["used_tokens"]


def wait_idle(http, timeout: float = 15.0) -> dict:
    """Poll /server_info until nothing runs, waits, is in flight or holds KV."""
    deadline = time.monotonic() + timeout
    while True:
        info = http.get("/server_info").json()
        if busy(info) == 0 or time.monotonic() > deadline:
            return info
        time.sleep(0.2)


LONG = {"messages": [{"role": "user", "content": "Count from 1 to 1000."}], "max_tokens": 200,
        "ignore_eos": True, "temperature": 0.0}


def aborted(http) -> float:
    lines = http.get("/metrics").text.splitlines()
    line = next(x for x in lines if x.startswith("moeserve:aborted_requests_total"))
    return float(line.split()[1])


def test_disconnect_mid_stream_aborts(http):
    before = aborted(http)
    with http.stream("POST", "/v1/chat/completions", json=LONG | {"stream": True}) as resp:
        assert resp.status_code == 200
        chunks = 0
        for line in resp.iter_lines():
            chunks += line.startswith("data: ")
            if chunks >= 3:
                break  # leaving the block closes the connection mid-stream
    info = wait_idle(http)
    assert busy(info) == 0, info
    assert aborted(http) == before + 1


def test_disconnect_non_streaming_aborts(http, server):
    before = aborted(http)
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/chat/completions", json=LONG, headers=AUTH, timeout=1.5)
    info = wait_idle(http)
    assert busy(info) == 0, info
    assert aborted(http) == before + 1
    out = http.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 3})
    assert out.status_code == 200 and out.json()["choices"][0]["message"]["content"] is not None


def test_generate_takes_json_whatever_the_content_type(http):
    body = b'{"text": "Hi", "sampling_params": {"max_new_tokens": 2, "temperature": 0}}'
    for ctype in ("text/plain", "application/x-www-form-urlencoded", None):
        headers = {"Content-Type": ctype} if ctype else {}
        resp = http.post("/generate", content=body, headers=headers)
        assert resp.status_code == 200, resp.text
        assert len(resp.json()["output_ids"]) == 2
    assert_error(http.post("/generate", content=b"text=Hi", headers={
        "Content-Type": "application/x-www-form-urlencoded"}))
    assert_error(http.post("/generate", json={"text": "Hi", "sampling_params": 5}))
    assert_error(http.post("/generate", json={"text": "Hi", "sampling_params": {
        "logit_bias": {"999999": 1.0}}}))


def test_tokenize_detokenize_and_model_info(http):
    from transformers import AutoTokenizer

    from moeserve.models.embedded import embedded_model_path

    tok = AutoTokenizer.from_pretrained(embedded_model_path())
    out = http.post("/tokenize", json={"prompt": "Hello world"}).json()
    assert out["tokens"] == tok("Hello world")["input_ids"] and out["count"] == len(out["tokens"])
    assert out["max_model_len"] == CONTEXT
    chat = http.post("/tokenize", json={"messages": MSG}).json()["tokens"]
    assert chat == tok.apply_chat_template(MSG, add_generation_prompt=True, tokenize=True,
                                           return_dict=True)["input_ids"]
    assert http.post("/detokenize", json={"tokens": out["tokens"]}).json() == {
        "prompt": "Hello world"}
    assert_error(http.post("/detokenize", json={"tokens": [10**9]}))
    assert_error(http.post("/tokenize", json={}))
    info = http.get("/get_model_info").json()
    assert info["is_generation"] is True and info["model_path"] == embedded_model_path()
