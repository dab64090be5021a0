"""ProcessGroup names the child that caused a shutdown, and its watchdog wakes at the exit itself."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import pytest

from moeserve.procs.children import STOP_SIGNAL, ProcessGroup


def _wait_exit(procs: ProcessGroup, name: str) -> None:
    child = next(c for c in procs.children if c.name == name)
    child.process.join(30)
    assert not child.process.is_alive()


def test_dead_prefers_the_signal_killed_child_over_earlier_peers_that_exited_with_errors():
    procs = ProcessGroup(log_level="warning")
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


def test_dead_names_the_first_started_among_error_exits():
    procs = ProcessGroup(log_level="warning")
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


def test_watchdog_reports_an_exit_without_waiting_out_its_interval():
    procs = ProcessGroup(log_level="warning")
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
def test_children_ignore_sigterm_and_stop_on_the_launchers_signal():
    """A group-wide SIGTERM (systemd, `timeout`) leaves the children to the launcher's drain;
    stop() still ends them cleanly (exit 0), not by SIGKILL."""
    procs = ProcessGroup(log_level="warning")
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
