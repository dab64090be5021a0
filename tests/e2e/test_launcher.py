"""Launcher supervision: SIGTERM → clean exit 0; a child's death → exit 1 naming it; a child
dying during start-up → exit 1; a SIGKILLed launcher leaves no orphan children. On a tiny llama:
supervision does not depend on the model, and a SmolLM2 start cost twice the CPU."""

from __future__ import annotations

import os
import shutil
import signal

import httpx
import pytest
from live_server import role_processes, still_running

psutil = pytest.importorskip("psutil")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def children(server) -> list:
    """The server's role processes (multiprocessing's resource tracker excluded)."""
    return role_processes(server.proc.pid)


def scheduler_process(server, kids: list):
    """The child that is not the detokenizer (which reports its pid when ready)."""
    detok = httpx.get(server.url + "/server_info").json()["ready"]["detokenizer:0"]["pid"]
    return next(p for p in kids if p.pid != detok)


@pytest.fixture(scope="module")
def tiny(tiny_model) -> str:
    return tiny_model("llama")


def test_sigterm_exits_zero_and_stops_children(launch, tiny):
    server = launch([f"model.path={tiny}"]).wait_healthy()
    kids = children(server)
    assert len(kids) == 2
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(30) == 0, server.log_tail()
    assert still_running(kids) == []
    assert "shutting down" in server.log_tail()


def test_child_death_brings_server_down(launch, tiny):
    server = launch([f"model.path={tiny}"]).wait_healthy()
    kids = children(server)
    scheduler_process(server, kids).kill()
    assert server.proc.wait(30) == 1, server.log_tail()
    assert still_running(kids) == []
    log = server.log_tail()
    assert "child process 'scheduler-0'" in log and "died with exit code -9" in log


def test_child_failing_at_start_up(launch, tiny, tmp_path):
    src = tiny
    for name in os.listdir(src):  # tokenizer and config, but no weights: the scheduler fails
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(src, name), tmp_path / name)
    server = launch([f"model.path={tmp_path}"])
    assert server.proc.wait(180) == 1, server.log_tail()
    assert "start-up failed: child process 'scheduler-0' exited with code" in server.log_tail()


def test_killed_launcher_leaves_no_orphans(launch, tiny):
    server = launch([f"model.path={tiny}"]).wait_healthy()
    kids = children(server)
    server.proc.kill()
    server.proc.wait(10)
    assert still_running(kids, timeout=10) == []
