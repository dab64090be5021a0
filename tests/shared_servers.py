"""Servers that several e2e modules share for the session (tests/e2e/conftest.py starts each at
most once in a worker), their arguments, and the pytest-xdist work units that keep each one's
modules in one worker (`--dist loadfile`, but a server's files together), so that it starts once
a run: a SmolLM2 server costs ~10-15 CPU-s from start to stop."""

from __future__ import annotations

from xdist.scheduler import LoadFileScheduling

# float32 SmolLM2 with the Hermes tool parser and the qwen3 reasoning parser, for the modules that
# compare float32 outputs with transformers' or with each other (the parsers act only on requests
# with tools and on replies that open with <think>). One forward thread: on 2 cores shared with
# the test process, two threads made a 16-prompt prefill 4-8x slower (0.75 s vs 3.4-6.3 s).
SMOLLM2_TOOLS_ARGS = ["model.dtype=float32", "server.tool_parser=hermes",
                      "server.reasoning_parser=qwen3", "scheduler.cpu_threads=1"]

# SmolLM2 in its default dtype (bf16 where native: test_structured_outputs' long generations cost
# less there than the server start they would save on the float32 one), with no tool parser, a
# short context and an API key, whose limits test_bad_input checks
SMOLLM2_KEY = "sk-test"
SMOLLM2_CONTEXT = 1024
SMOLLM2_LIMITS_ARGS = [f"model.context_length={SMOLLM2_CONTEXT}", f"server.api_key={SMOLLM2_KEY}"]

# fixture -> the files that use it (tests/e2e/conftest.py checks this at collection)
USERS = {
    "smollm2_tools_server": frozenset(f"tests/e2e/{name}.py" for name in (
        "test_harness_api", "test_lm_eval", "test_openai_api", "test_openai_extras")),
    "smollm2_limits_server": frozenset(f"tests/e2e/{name}.py" for name in (
        "test_bad_input", "test_structured_outputs")),
}


class SharedServerScheduling(LoadFileScheduling):
    """loadfile, but the files of a shared server are one work unit."""

    def _split_scope(self, nodeid: str) -> str:
        scope = super()._split_scope(nodeid)
        return next((fixture for fixture, files in USERS.items() if scope in files), scope)
