"""Child processes of a launcher (the server, or the offline Engine's ranks): start (a fork
server's fork, or spawn), liveness checks, a watchdog, and no orphans.

Why each piece:
- a fork server (forkserver.py) or spawn, never a fork of the launcher: the main process has an
  asyncio loop, ZMQ contexts and maybe CUDA state that must not be duplicated into the children.
- A child dies with its parent (PR_SET_PDEATHSIG on Linux, plus a thread that watches getppid() as a
  portable fallback), so a SIGKILLed launcher leaves no scheduler holding memory or a GPU.
- Children ignore SIGINT and SIGTERM while their launcher lives: Ctrl-C reaches the whole process
  group, and systemd, `timeout` and container runtimes send SIGTERM to every process of a group or
  cgroup, yet only the launcher decides how to shut down (it drains HTTP first; otherwise the
  watchdog would see children die and report a crash). The launcher stops them with STOP_SIGNAL
  (a clean exit); `stop()` SIGKILLs what is still alive after a grace period.
"""

from __future__ import annotations

import _thread
import ctypes
import logging
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from moeserve.procs.forkserver import PRELOAD, LauncherState, fork_server_guard, release_fork_server

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
LOG_FORMAT = "%(asctime)s %(levelname)s [%(processName)s] %(name)s: %(message)s"


class ChildDied(RuntimeError):
    def __init__(self, name: str, exitcode: int | None):
        super().__init__(f"child process '{name}' exited with code {exitcode}")
        self.name, self.exitcode = name, exitcode


def setup_logging(level: str, log_file: str | None = None) -> None:
    """Log to stderr, and also append to `log_file` (the launcher's run dir) when given."""
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if log_file is not None:
        handlers.append(logging.FileHandler(log_file))
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT, handlers=handlers, force=True)


def _die_with_parent(parent: int) -> None:
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


STOP_SIGNAL = signal.SIGUSR1  # launcher → child: exit now


STOP_GRACE_S = 2.0


def _exit_on_stop(signum: int, _frame: Any) -> None:
    """STOP_SIGNAL (in the main thread) → SystemExit, so atexit hooks and finalizers run
    (shared-memory and semaphore bookkeeping of multiprocessing's resource tracker, pools)."""
    sys.exit(0)


def _stop_watcher() -> None:
    """Take STOP_SIGNAL in a thread of its own (it is blocked everywhere else), so it is seen
    even while the main thread waits inside a C++ call, e.g. a rank in a collective whose peer
    already left: ask the main thread to exit (its handler runs at the next bytecode), and exit
    at once, skipping finalizers (no C++ teardown errors), if it has not after STOP_GRACE_S."""
    signal.sigwait({STOP_SIGNAL})
    _thread.interrupt_main(STOP_SIGNAL)
    time.sleep(STOP_GRACE_S)
    logging.shutdown()
    os._exit(0)


def _sigterm_handler(parent: int) -> Callable[[int, Any], None]:
    def on_sigterm(signum: int, _frame: Any) -> None:
        if os.getppid() != parent:  # orphaned: nobody else will stop this process
            sys.exit(0)
        logger.info("SIGTERM ignored: the launcher (pid %d) drains and stops this process", parent)

    return on_sigterm


def child_entry(name: str, parent: int, log_level: str, target: Callable[..., Any],
                args: tuple, log_file: str | None = None,
                launcher: LauncherState | None = None) -> None:
    """Top-level entry of every child: guard against orphaning, then run the role's function.
    `launcher`: forked by the launcher's fork server, whose own parent is the launcher and which
    exits with it; the guard watches the fork server then."""
    if launcher is not None:
        release_fork_server()
        launcher.apply()
        guard = fork_server_guard(parent)
        if guard is None:
            os._exit(1)
        parent = guard
    signal.pthread_sigmask(signal.SIG_BLOCK, {STOP_SIGNAL})  # before any thread: all inherit it
    signal.signal(STOP_SIGNAL, _exit_on_stop)
    threading.Thread(target=_stop_watcher, name="stop-watch", daemon=True).start()
    _die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _sigterm_handler(parent))
    setup_logging(log_level, log_file)
    target(*args)


@dataclass
class Child:
    name: str
    process: mp.process.BaseProcess


class ProcessGroup:
    """The server's children; `stop()` is idempotent and silences the watchdog first."""

    def __init__(self, log_level: str = "info", log_file: str | None = None,
                 start_method: str = "spawn"):
        self._ctx = mp.get_context(start_method)
        self._forked = start_method == "forkserver"
        if self._forked:
            self._ctx.set_forkserver_preload(PRELOAD)  # no effect once this process' one started
        self._log_level = log_level
        self._log_file = log_file
        self.children: list[Child] = []
        self.stopping = threading.Event()

    def start(self, name: str, target: Callable[..., Any], args: tuple) -> None:
        """Start a child; call from the main thread (PDEATHSIG follows the forking thread)."""
        proc = self._ctx.Process(target=child_entry, name=name, daemon=False,
                                 args=(name, os.getpid(), self._log_level, target, args,
                                       self._log_file,
                                       LauncherState.capture() if self._forked else None))
        proc.start()
        logger.info("started %s (pid %d)", name, proc.pid)
        self.children.append(Child(name, proc))

    def dead(self) -> Child | None:
        """The exited child most likely to be the cause: one killed by a signal (its peers then
        fail their collectives and exit with an error after it), else the first in start order
        (a dead node-1 tree, started first, when its peers' collectives fail after it)."""
        gone = [c for c in self.children if not c.process.is_alive()]
        return min(gone, key=lambda c: (c.process.exitcode or 0) >= 0, default=None)

    def check_alive(self) -> None:
        """Raise ChildDied naming the dead child most likely to be the cause (see dead)."""
        child = self.dead()
        if child is not None:
            raise ChildDied(child.name, child.process.exitcode)

    def stop(self, timeout: float = 5.0) -> None:
        """STOP_SIGNAL to every child, wait up to `timeout` s in total, SIGKILL the rest."""
        self.stopping.set()
        for c in self.children:
            if c.process.is_alive():
                try:
                    os.kill(c.process.pid, STOP_SIGNAL)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + timeout
        for c in self.children:
            c.process.join(max(0.0, deadline - time.monotonic()))
            if c.process.is_alive():
                logger.warning("%s did not stop after %s; killing it", c.name, STOP_SIGNAL.name)
                c.process.kill()
                c.process.join(2.0)

    def start_watchdog(self, on_death: Callable[[Child], None], interval: float = 0.5) -> None:
        """Call `on_death(child)` once, from a thread, when a child exits outside `stop()`."""
        def watch() -> None:
            while not self.stopping.is_set():  # wakes at the first exit, so its cause is alone
                mp_connection.wait([c.process.sentinel for c in self.children], timeout=interval)
                child = self.dead()
                if child is not None and not self.stopping.is_set():
                    on_death(child)
                    return

        threading.Thread(target=watch, name="child-watchdog", daemon=True).start()
