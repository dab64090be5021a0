"""Launcher supervision: SIGTERM → clean exit 0; a child dying during start-up → exit 1; a
SIGKILLed launcher leaves no orphan children. On a tiny llama: supervision does not depend on the
model, and a SmolLM2 start cost twice the CPU. A child's death (exit 1 naming it, every other
child stopped) is test_faults.py's `kill -9` of each role, the scheduler's included."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import pytest
from live_server import REPO, role_processes, still_running

psutil = pytest.importorskip("psutil")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def children(server) -> list:
    """The server's role processes (multiprocessing's resource tracker excluded)."""
    return role_processes(server.proc.pid)


@pytest.fixture(scope="module")
def tiny(tiny_model) -> str:
    return tiny_model("llama")


def test_sigterm_exits_zero_and_stops_children(launch, tiny):
    """...and its fork server: ended and reaped by the launcher before it exits (left alone, it
    tore its interpreter down for seconds after)."""
    server = launch([f"model.path={tiny}"]).wait_healthy()
    kids = children(server)
    assert len(kids) == 2
    (fork_server,) = [p for p in psutil.Process(server.proc.pid).children()
                      if "forkserver" in " ".join(p.cmdline())]
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(30) == 0, server.log_tail()
    assert not psutil.pid_exists(fork_server.pid)
    assert still_running(kids) == []
    assert "shutting down" in server.log_tail()
    assert server.log_tail().rstrip().endswith("all child processes stopped")  # log flushed


def test_exit_now_runs_atexit_hooks_and_flushes():
    """procs/exit.exit_now, the launchers' and the ranks' exit: the code, the atexit hooks, and
    whatever stdout still buffered."""
    script = ("import atexit, sys; from moeserve.procs.exit import exit_now; "
              "atexit.register(lambda: sys.stdout.write(' atexit ran')); "
              "sys.stdout.write('buffered'); exit_now(3)")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert (done.returncode, done.stdout) == (3, "buffered atexit ran"), done.stderr


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
