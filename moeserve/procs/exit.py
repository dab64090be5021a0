"""Ending a process whose work is done without the interpreter's teardown.

Python's exit collects every module's objects (with torch and transformers loaded, the whole torch
heap), then runs libtorch's static destructors. Nothing a finished process still needs happens
there: a scheduler rank spent 2-3 s in it on the 2-core CI machine under load, racing its
launcher's 5 s stop limit (scheduler/shutdown.py), and a server's launcher 1.4 CPU-s (5 s under
load) after its children had stopped, which every server stop waited for.
"""

from __future__ import annotations

import atexit
import os
import sys
from typing import NoReturn


def exit_now(code: int = 0) -> NoReturn:
    """Run the atexit hooks (logging's flush, multiprocessing's finalizers, which unlink named
    semaphores such as tqdm's lock: skipped, the resource tracker warns of leaked semaphores),
    flush stdio, then end with `code` at once."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    os._exit(code)
