"""Clearing the fast-path kill switches, for the tests of the fast paths themselves (a module of its
own: `from conftest import ...` resolves to whichever conftest.py pytest imported first)."""

from __future__ import annotations

import pytest


def unforce_fast_paths(mp: pytest.MonkeyPatch) -> None:
    """Clear every MOESERVE_DISABLE_* variable: for the tests of the fast paths themselves, which
    must test them even in a run that forces them off everywhere else."""
    from moeserve.env import FAST_PATH_FLAGS

    for var in FAST_PATH_FLAGS:
        mp.delenv(var, raising=False)
