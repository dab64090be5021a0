"""schemathesis against the live server's OpenAPI document: `schemathesis run --checks all` (its
coverage, fuzzing and stateful phases, positive and negative requests, every check: no 5xx,
documented statuses, bodies and content types, schema-valid requests served, schema-violating
ones refused, the API key enforced, responses within 10 s) finds no failure; afterwards /health
is 200 and the request table, KV pool and radix cache are back to baseline (see
moeserve.tools.fuzz_api; scripts/fuzz.sh runs the long version)."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("schemathesis")

from moeserve.tools.fuzz_api import check_baseline, schemathesis_cli  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

KEY = "sk-fuzz"
FUZZ_SECONDS = 40


@pytest.fixture(scope="module")
def server(tiny_model):
    from live_server import LiveServer

    # A long context so that no generated prompt outgrows it (a prompt the context cannot hold is
    # a 400 that JSON Schema cannot state), short completions (server.max_completion_tokens) so
    # that every answer comes within the check's 10 s, n <= 2
    path = tiny_model("llama", max_position_embeddings=16384)
    live = LiveServer([f"model.path={path}", "model.dtype=float32", "server.max_n=2",
                       "server.max_completion_tokens=8", "scheduler.cpu_threads=1",
                       f"server.api_key={KEY}"]).wait_healthy()
    yield live
    live.stop()


def test_schemathesis_run_checks_all_passes(server):
    auth = {"Authorization": f"Bearer {KEY}"}
    run = schemathesis_cli(server.url, FUZZ_SECONDS, seed=0, headers=auth)
    print(run.summary)
    assert run.returncode == 0 and "No issues found" in run.output, run.output[-6000:]
    generated = re.search(r"(\d+) generated, (\d+) passed", run.output)
    assert generated and int(generated[1]) == int(generated[2]) >= 500, run.summary
    assert check_baseline(server.url, auth) == []
    assert server.proc.poll() is None
