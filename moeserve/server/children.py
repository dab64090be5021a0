"""Child processes of the server: start (spawn), liveness checks, a watchdog, and no orphans.

Why each piece:
- spawn, not fork: the main process has an asyncio loop, ZMQ contexts and maybe CUDA state that must
  not be duplicated into the children.
- A child dies with its parent (PR_SET_PDEATHSIG on Linux, plus a thread that watches getppid() as a
  portable fallback), so a SIGKILLed launcher leaves no scheduler holding memory or a GPU.
- Children ignore SIGINT: Ctrl-C reaches the whole process group, and only the launcher decides
  how to shut down (otherwise the watchdog would see children die and report a crash). SIGTERM
  exits cleanly; `stop()` SIGKILLs what is still alive after a grace period.
"""

from __future__ import annotations

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


def _exit_on_sigterm(signum: int, _frame: Any) -> None:
    """SIGTERM → SystemExit, so atexit hooks and finalizers run (shared-memory and semaphore
    bookkeeping of multiprocessing's resource tracker, thread pools)."""
    sys.exit(0)


def child_entry(name: str, parent: int, log_level: str, target: Callable[..., Any],
                args: tuple, log_file: str | None = None) -> None:
    """Top-level entry of every child: guard against orphaning, then run the role's function."""
    _die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    setup_logging(log_level, log_file)
    target(*args)


@dataclass
class Child:
    name: str
    process: mp.process.BaseProcess


class ProcessGroup:
    """The server's children; `stop()` is idempotent and silences the watchdog first."""

    def __init__(self, log_level: str = "info", log_file: str | None = None):
        self._ctx = mp.get_context("spawn")
        self._log_level = log_level
        self._log_file = log_file
        self.children: list[Child] = []
        self.stopping = threading.Event()

    def start(self, name: str, target: Callable[..., Any], args: tuple) -> None:
        """Start a child; call from the main thread (PDEATHSIG follows the forking thread)."""
        proc = self._ctx.Process(target=child_entry, name=name, daemon=False,
                                 args=(name, os.getpid(), self._log_level, target, args,
                                       self._log_file))
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
        """SIGTERM every child, wait up to `timeout` s in total, SIGKILL the rest."""
        self.stopping.set()
        for c in self.children:
            if c.process.is_alive():
                c.process.terminate()
        deadline = time.monotonic() + timeout
        for c in self.children:
            c.process.join(max(0.0, deadline - time.monotonic()))
            if c.process.is_alive():
                logger.warning("%s did not stop after SIGTERM; killing it", c.name)
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
