"""A live `python -m launch.server` per test module, on a free loopback port.

A module sets `SERVER_ARGS = [...]` (Hydra overrides) to configure its server; the `server` fixture
starts it once, waits for /health and stops it (SIGTERM, then SIGKILL) after the module. The
session's shared servers (shared_servers.py) serve the modules listed there.
"""

from __future__ import annotations

import os

import pytest
from live_server import LiveServer
from shared_servers import SMOLLM2_LIMITS_ARGS, SMOLLM2_TOOLS_ARGS, USERS


@pytest.fixture(scope="module")
def server(request):
    live = LiveServer(list(getattr(request.module, "SERVER_ARGS", []))).wait_healthy()
    yield live
    code = live.stop(keep_log=True)
    if code == 0:
        os.unlink(live.log.name)


def _shared(args: list[str]):
    live = LiveServer(args).wait_healthy()
    yield live
    code = live.stop(keep_log=True)
    if code == 0:
        os.unlink(live.log.name)


@pytest.fixture(scope="session")
def smollm2_tools_server():
    """shared_servers.SMOLLM2_TOOLS_ARGS: float32, Hermes tools, qwen3 reasoning."""
    yield from _shared(SMOLLM2_TOOLS_ARGS)


@pytest.fixture(scope="session")
def smollm2_limits_server():
    """shared_servers.SMOLLM2_LIMITS_ARGS: default dtype, short context, API key."""
    yield from _shared(SMOLLM2_LIMITS_ARGS)


def pytest_collection_modifyitems(config, items):
    """A file that uses a shared server must be among shared_servers.USERS: else xdist may run it
    in another worker, which starts the server once more."""
    for fixture, files in USERS.items():
        users = {item.nodeid.split("::")[0] for item in items
                 if fixture in getattr(item, "fixturenames", ())}
        if users - files:
            raise pytest.UsageError(f"add {sorted(users - files)} to tests/shared_servers.py "
                                    f"USERS[{fixture!r}]")


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
