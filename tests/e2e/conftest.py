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
