"""The PD tests' dependency check: Mooncake's transfer engine must load. CI runs as root in a fresh
container, so a missing Debian libibverbs1 is installed here; anything still missing fails the test
loudly (never a skip: a CI without the library would otherwise pass without testing PD)."""

from __future__ import annotations

import os
import subprocess

import pytest


def _engine_loads() -> str | None:
    """None when mooncake.engine imports (in a child: a failed import of the .so is cached)."""
    import sys

    r = subprocess.run([sys.executable, "-c", "import mooncake.engine"], capture_output=True,
                       check=False, text=True, timeout=120)
    return None if r.returncode == 0 else (r.stderr.strip().splitlines() or ["?"])[-1]


def require_mooncake() -> None:
    error = _engine_loads()
    if error is not None and "libibverbs" in error and os.geteuid() == 0:
        subprocess.run(["apt-get", "install", "-y", "-q", "libibverbs1"], capture_output=True,
                       check=False, timeout=600)
        if _engine_loads() is not None:  # a stale package list: refresh it once
            subprocess.run(["apt-get", "update", "-q"], capture_output=True, check=False,
                           timeout=600)
            subprocess.run(["apt-get", "install", "-y", "-q", "libibverbs1"],
                           capture_output=True, check=False, timeout=600)
        error = _engine_loads()
    if error is not None:
        pytest.fail("PD tests need Mooncake's transfer engine (pip: "
                    "mooncake-transfer-engine-non-cuda, in the `test` extra) and Debian's "
                    f"libibverbs1 (apt-get install -y libibverbs1); import failed: {error}")
