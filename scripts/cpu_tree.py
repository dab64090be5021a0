"""Run a command and print its wall time and the CPU seconds of every process it started.

    python scripts/cpu_tree.py python -m pytest -q

`/usr/bin/time` counts only descendants that their parents reap; a fork server's children
(server.start_method=forkserver) are reaped by the fork server, which may itself be orphaned when
its launcher exits, and their CPU time is then lost. This process makes itself a child subreaper
(Linux), so every orphan of the tree is reparented here and reaped at the end, and
RUSAGE_CHILDREN covers the whole tree.
"""

from __future__ import annotations

import ctypes
import os
import resource
import subprocess
import sys
import time

PR_SET_CHILD_SUBREAPER = 36


def main(argv: list[str]) -> int:
    if not argv:
        raise SystemExit(__doc__)
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    start = time.monotonic()
    code = subprocess.call(argv)
    while True:
        try:
            os.wait()
        except ChildProcessError:
            break
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(f"cpu_tree: rc={code} wall {time.monotonic() - start:.1f} s cpu "
          f"{usage.ru_utime:.1f}+{usage.ru_stime:.1f} = {usage.ru_utime + usage.ru_stime:.1f} s",
          file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
