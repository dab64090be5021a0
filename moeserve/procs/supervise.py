"""Taking a process tree down: the launcher turns SIGINT/SIGTERM into KeyboardInterrupt (its
`finally` then stops the children), and a child that dies on its own takes the whole tree down
with exit code 1 and a log line naming it (no orphans, no half-alive deployment)."""

from __future__ import annotations

import logging
import os
import signal
from typing import Any

from moeserve.ipc.queues import Endpoints
from moeserve.procs.children import Child, ProcessGroup
from moeserve.procs.forkserver import end_fork_server
from moeserve.procs.ipc_files import remove_ipc_files

logger = logging.getLogger(__name__)


def _raise_interrupt(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def interrupt_on_signals() -> None:
    """SIGTERM and SIGINT raise KeyboardInterrupt (named after the signal) in the main thread."""
    signal.signal(signal.SIGTERM, _raise_interrupt)
    signal.signal(signal.SIGINT, _raise_interrupt)


def exit_on_child_death(child: Child, procs: ProcessGroup, endpoints: Endpoints) -> None:
    """Watchdog callback (a thread): one child died, so the whole server goes down with exit 1.
    The likeliest cause among the dead children is named (ProcessGroup.dead)."""
    child = procs.dead() or child
    logger.error("child process '%s' (pid %s) died with exit code %s; shutting the server down",
                 child.name, child.process.pid, child.process.exitcode)
    procs.stop(timeout=2.0)  # ranks blocked in a collective with the dead one never answer
    remove_ipc_files(endpoints)
    end_fork_server()
    logging.shutdown()
    os._exit(1)
