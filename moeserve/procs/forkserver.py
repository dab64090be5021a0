"""Children forked from a fork server (`server.start_method=forkserver`, the default).

Why: every scheduler rank, the DP controller and the detokenizer of a launcher import torch and
transformers, ~3 CPU-s each, so a DP4 server paid it six times. multiprocessing's fork server
imports them once (PRELOAD) and forks each child from that state: a DP4 Engine's start, 8
requests and stop took 18.5 -> 13.5 CPU-s on 2 CPU cores. It is started fresh (spawned) and never
runs a thread, a socket or CUDA, so nothing of the sort reaches a child, as with spawn.

What a spawned child gets from its launcher at the time of the start and a forked one would take
from the fork server's start instead is handed over explicitly (`LauncherState`): the
environment, the working directory and stdout/stderr (a test's captured output, a log file).
A launcher keeps one fork server for its life; it exits when its launcher does, and its
children, whose parent it is, die with it (children.py's guard watches it). That holds only once
each child has closed the launcher's end of the server's liveness pipe, which multiprocessing hands
every child (`release_fork_server`): while one held it, the server never saw its launcher die.
"""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass
from multiprocessing import reduction

# imported once by each launcher's fork server: the import floor of a rank (torch, transformers'
# config and tokenizer classes; what a model's config module imports on first use:
# type_validators pulls in activations, hub kernels, accelerate and sympy, 700 modules and
# 1.0 CPU-s that each rank paid in AutoConfig; Hydra's config store that moeserve.config
# imports: 0.3 s of a core per child; Triton where installed: 0.15 s; a missing one is skipped);
# no moeserve module, so that each child imports ours under its launcher's environment (Triton
# reads its knobs, e.g. TRITON_INTERPRET, from the environment when they are used, not at import)
PRELOAD = ["torch", "torch.distributed", "transformers",
           "transformers.models.auto.configuration_auto",
           "transformers.models.auto.tokenization_auto", "transformers.utils.type_validators",
           "hydra.core.config_store", "triton"]


class _InheritFd:
    """A file descriptor of the launcher that travels to the child with the Process' arguments
    (multiprocessing passes it over the fork server's socket)."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return _received, (reduction.DupFd(self.fd),)


def _received(dup) -> int:
    return dup.detach()


@dataclass
class LauncherState:
    env: dict[str, str]
    cwd: str
    stdio: tuple  # (stdout, stderr): _InheritFd in the launcher, file descriptors in the child

    @classmethod
    def capture(cls) -> LauncherState:
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
        return cls(dict(os.environ), os.getcwd(), (_InheritFd(1), _InheritFd(2)))

    def apply(self) -> None:
        """In the child, first thing."""
        os.environ.clear()
        os.environ.update(self.env)
        os.chdir(self.cwd)
        for target, fd in zip((1, 2), self.stdio):
            os.dup2(fd, target)
            os.close(fd)


def fork_server_guard(launcher: int) -> int | None:
    """In a forked child: the pid to guard (its parent, the fork server) while the fork server is
    still the launcher's child; None when the launcher is already gone (then the fork server
    exits, or did, and the child may have been reparented before it could look)."""
    server = os.getppid()
    try:
        with open(f"/proc/{server}/stat") as f:
            server_parent = int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):  # no /proc: trust the parent
        return server
    return server if server_parent == launcher else None


def release_fork_server() -> None:
    """In a forked child, first thing: close the launcher's end of the fork server's liveness
    pipe, which multiprocessing gives each child so that it could fork through the same server
    (ours start none). With it open in a child, a SIGKILLed launcher left the server, and so
    every child, running."""
    from multiprocessing import forkserver

    server = forkserver._forkserver
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None:
        os.close(fd)
        server._forkserver_alive_fd = None


def end_fork_server() -> None:
    """In a launcher about to exit, its children stopped: end its fork server now (SIGKILL).
    Left alone, it sees the launcher gone and exits through the interpreter's teardown (torch and
    transformers loaded: 0.75 CPU-s a server); it holds nothing that needs it (its socket file's
    folder goes with the launcher's atexit hooks)."""
    from multiprocessing import forkserver

    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
    if pid is None:
        return
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass
