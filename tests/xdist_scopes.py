"""pytest-xdist's work units (`--dist loadfile`: a file runs whole in one worker), with the files
that share a session-scoped server in one unit, so that the server starts once a run rather than
once in each worker that runs one of them (a SmolLM2 server costs ~10 CPU-s from start to stop)."""

from __future__ import annotations

from xdist.scheduler import LoadFileScheduling

# tests/e2e/conftest.py `smollm2_tools_server` (its users are checked at collection)
SMOLLM2_TOOLS_FILES = frozenset(f"tests/e2e/{name}.py" for name in (
    "test_harness_api", "test_lm_eval", "test_openai_api", "test_openai_extras"))


class SharedServerScheduling(LoadFileScheduling):
    """loadfile, but the files of SMOLLM2_TOOLS_FILES are one work unit."""

    def _split_scope(self, nodeid: str) -> str:
        scope = super()._split_scope(nodeid)
        return "smollm2_tools_server" if scope in SMOLLM2_TOOLS_FILES else scope
