"""A live `python -m launch.server` per test module, on a free loopback port.

A module sets `SERVER_ARGS = [...]` (Hydra overrides) to configure its server; the `server` fixture
starts it once, waits for /health and stops it (SIGTERM, then SIGKILL) after the module.
"""

from __future__ import annotations

import os

import pytest
from live_server import LiveServer


@pytest.fixture(scope="module")
def server(request):
    live = LiveServer(list(getattr(request.module, "SERVER_ARGS", []))).wait_healthy()
    yield live
    code = live.stop(keep_log=True)
    if code == 0:
        os.unlink(live.log.name)


# float32 SmolLM2 with the Hermes tool parser and the qwen3 reasoning parser: the float32 SmolLM2
# modules share one server for the session (a start costs ~20 s on 2 cores), and under xdist one
# worker (xdist_scopes.py). Not test_structured_outputs.py: on bf16 (the default here) its long
# generations took 25 CPU-s fewer than on this server, more than a start costs. One forward thread: on 2 cores shared with the test process, two threads
# made a 16-prompt prefill 4-8x slower (0.75 s vs 3.4-6.3 s).
SMOLLM2_TOOLS_ARGS = ["model.dtype=float32", "server.tool_parser=hermes",
                      "server.reasoning_parser=qwen3", "scheduler.cpu_threads=1"]


@pytest.fixture(scope="session")
def smollm2_tools_server():
    live = LiveServer(SMOLLM2_TOOLS_ARGS).wait_healthy()
    yield live
    code = live.stop(keep_log=True)
    if code == 0:
        os.unlink(live.log.name)


def pytest_collection_modifyitems(config, items):
    """A file that uses smollm2_tools_server must be in xdist_scopes.SMOLLM2_TOOLS_FILES: else
    xdist may run it in another worker, which starts the server once more."""
    from xdist_scopes import SMOLLM2_TOOLS_FILES

    users = {item.nodeid.split("::")[0] for item in items
             if "smollm2_tools_server" in getattr(item, "fixturenames", ())}
    if users - SMOLLM2_TOOLS_FILES:
        raise pytest.UsageError(f"add {sorted(users - SMOLLM2_TOOLS_FILES)} to "
                                "tests/xdist_scopes.py SMOLLM2_TOOLS_FILES")


@pytest.fixture
def launch():
    """launch(args) -> LiveServer (not yet healthy); every one is stopped after the test."""
    started: list[LiveServer] = []

    def start(args: list[str]) -> LiveServer:
        started.append(LiveServer(args))
        return started[-1]

    yield start
    for live in started:
        live.stop()
