"""schemathesis against the live server's OpenAPI document (every route, valid and invalid
requests, ~300 examples, bounded in time): every response is a 2xx or a 4xx in OpenAI's error
format, none hangs, and afterwards /health is 200 and the request table, KV pool and radix cache
are back to baseline (see moeserve.tools.fuzz_api; scripts/fuzz.sh runs the long version)."""

from __future__ import annotations

import pytest

pytest.importorskip("schemathesis")

from moeserve.tools.fuzz_api import fuzz  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

KEY = "sk-fuzz"


@pytest.fixture(scope="module")
def server(tiny_model):
    from live_server import LiveServer

    path = tiny_model("llama")  # a 64-token context and n <= 2 keep valid requests short
    live = LiveServer([f"model.path={path}", "model.dtype=float32", "model.context_length=64",
                       "server.max_n=2", f"server.api_key={KEY}"]).wait_healthy()
    yield live
    live.stop()


def test_fuzzed_requests_get_2xx_or_openai_4xx(server):
    report = fuzz(server.url, max_examples=150, time_limit_s=240, request_timeout_s=60,
                  headers={"Authorization": f"Bearer {KEY}"})
    print(report.summary())
    assert report.requests >= 100, report.summary()  # the budget was mostly spent
    assert report.problems == [], "\n".join(report.problems[:20])
    assert report.server_errors == 0
    assert report.baseline == [], report.baseline
    assert server.proc.poll() is None
