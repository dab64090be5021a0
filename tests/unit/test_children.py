"""ProcessGroup names the child that caused a shutdown, and its watchdog wakes at the exit itself;
under both start methods. A fork server's child gets its launcher's environment, working directory
and stderr as of its start (not the fork server's), and dies with its launcher."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import pytest

from moeserve.config import START_METHODS
from moeserve.procs.children import STOP_SIGNAL, ProcessGroup


@pytest.fixture(params=START_METHODS)
def start_method(request) -> str:
    return request.param


def _wait_exit(procs: ProcessGroup, name: str) -> None:
    child = next(c for c in procs.children if c.name == name)
    child.process.join(30)
    assert not child.process.is_alive()


def test_dead_prefers_the_signal_killed_child_over_earlier_peers_that_exited_with_errors(start_method):
    procs = ProcessGroup(log_level="warning", start_method=start_method)
    try:
        procs.start("peer", sys.exit, (1,))  # started first: a rank whose collective failed
        procs.start("victim", time.sleep, (60,))
        _wait_exit(procs, "peer")
        os.kill(procs.children[1].process.pid, signal.SIGKILL)
        _wait_exit(procs, "victim")
        dead = procs.dead()
        assert dead is not None and dead.name == "victim" and dead.process.exitcode == -9
    finally:
        procs.stop()


def test_dead_names_the_first_started_among_error_exits(start_method):
    procs = ProcessGroup(log_level="warning", start_method=start_method)
    try:
        procs.start("a", time.sleep, (60,))
        procs.start("b", sys.exit, (3,))
        _wait_exit(procs, "b")
        assert procs.dead().name == "b"
        os.kill(procs.children[0].process.pid, STOP_SIGNAL)
        _wait_exit(procs, "a")
        assert procs.dead().name == "a"  # no signal among them (a stop exits 0): start order
    finally:
        procs.stop()


def test_watchdog_reports_an_exit_without_waiting_out_its_interval(start_method):
    procs = ProcessGroup(log_level="warning", start_method=start_method)
    seen: list[str] = []
    fired = threading.Event()
    try:
        procs.start("sleeper", time.sleep, (60,))
        procs.start_watchdog(lambda c: (seen.append(c.name), fired.set()), interval=60.0)
        time.sleep(0.5)
        os.kill(procs.children[0].process.pid, signal.SIGKILL)
        assert fired.wait(20), "the watchdog waited for its 60 s poll instead of the exit"
        assert seen == ["sleeper"]
    finally:
        procs.stop()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_children_ignore_sigterm_and_stop_on_the_launchers_signal(start_method):
    """A group-wide SIGTERM (systemd, `timeout`) leaves the children to the launcher's drain;
    stop() still ends them cleanly (exit 0), not by SIGKILL."""
    procs = ProcessGroup(log_level="warning", start_method=start_method)
    try:
        procs.start("worker", time.sleep, (60,))
        child = procs.children[0].process
        deadline = time.monotonic() + 60
        while not _catches(child.pid, signal.SIGTERM):  # past child_entry's handler set-up
            assert time.monotonic() < deadline and child.is_alive()
            time.sleep(0.1)
        os.kill(child.pid, signal.SIGTERM)
        child.join(2.0)
        assert child.is_alive()
        procs.stop(timeout=20)
        assert child.exitcode == 0
    finally:
        procs.stop()


def _catches(pid: int, sig: int) -> bool:
    """Whether process `pid` has a handler installed for `sig` (Linux: SigCgt in /proc)."""
    with open(f"/proc/{pid}/status") as f:
        mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    return bool(mask >> (sig - 1) & 1)


def test_forked_child_gets_the_launchers_state_at_its_start(tmp_path, monkeypatch, capfd):
    procs = ProcessGroup(log_level="warning", start_method="forkserver")
    try:
        procs.start("first", time.sleep, (0,))  # the fork server now runs, with the old state
        _wait_exit(procs, "first")
        monkeypatch.setenv("MOESERVE_TEST_LATE", "set-after-the-fork-server-started")
        monkeypatch.chdir(tmp_path)
        procs.start("shell", os.system, ('printf "%s|%s" "$MOESERVE_TEST_LATE" "$PWD" > out.txt',))
        procs.start("writer", os.write, (2, b"to the launcher's stderr\n"))
        _wait_exit(procs, "shell")
        _wait_exit(procs, "writer")
        assert (tmp_path / "out.txt").read_text() == f"set-after-the-fork-server-started|{tmp_path}"
        assert "to the launcher's stderr" in capfd.readouterr().err
    finally:
        procs.stop()


LAUNCHER = """
import sys, time
from moeserve.procs.children import ProcessGroup
procs = ProcessGroup(log_level="warning", start_method=sys.argv[1])
procs.start("orphan-candidate", time.sleep, (120,))
print(procs.children[0].process.pid, flush=True)
time.sleep(120)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG")
def test_a_killed_launcher_leaves_no_child(start_method):
    import subprocess

    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, start_method],
                                stdout=subprocess.PIPE, text=True)
    try:
        child = int(launcher.stdout.readline())
        deadline = time.monotonic() + 60
        while not _catches(child, signal.SIGTERM):  # running: past child_entry's guard set-up
            assert time.monotonic() < deadline and _alive(child)
            time.sleep(0.1)
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait(10)
        deadline = time.monotonic() + 20
        while _alive(child):
            assert time.monotonic() < deadline, "the child outlived its SIGKILLed launcher"
            time.sleep(0.1)
    finally:
        launcher.kill()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
