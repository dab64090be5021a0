"""Shared fixtures: tiny random checkpoints (built once per session) and the GPU skip rule."""

from __future__ import annotations

import os
import sys

import pytest
from fast_paths import unforce_fast_paths

# Under pytest-xdist each worker (and every server it starts) runs one forward thread: two
# workers of two OpenMP threads each on 2 cores spin in each other's barriers (env.usable_cpus).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"

import torch  # noqa: E402  (after OMP_NUM_THREADS)

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

# Without CUDA the Triton kernels run in Triton's interpreter (float32 is exact there; bf16 is
# not). It must be set before a kernel module is imported: @triton.jit reads it at decoration.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject's addopts): one worker per usable core, at most 4 (each starts
    servers of its own); one where CUDA is, so GPU tests never share the card."""
    from moeserve.env import usable_cpus

    return 1 if torch.cuda.is_available() else min(4, usable_cpus())


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile` (pyproject's addopts) with the files that share a session server in one
    work unit (shared_servers.py); any other mode is xdist's own."""
    if config.getvalue("dist") != "loadfile":
        return None
    from shared_servers import SharedServerScheduling

    return SharedServerScheduling(config, log)


def pytest_collection_finish(session):
    """Everything imported and collected so far (torch, transformers, the test modules) lives
    for the whole run: frozen out of the garbage collector, so the full collections that follow
    (automatic ones, and each offline Engine's stop: scheduler/shutdown.py) scan only what the
    tests made since. An Engine's stop collected for ~0.3 s of a core in a test worker."""
    import gc

    gc.collect()
    gc.freeze()


def pytest_sessionfinish(session):
    import gc

    gc.unfreeze()  # collectable again at exit (nanobind reports what is left as leaked)


def pytest_runtest_setup(item):
    """Triton's interpreter without the work it repeats (tests/triton_interpreter.py), once a
    test module or an earlier test imported triton (importing it here would cost every worker
    that runs no kernel 0.2 s)."""
    if os.environ.get("TRITON_INTERPRET") == "1" and "triton.runtime.interpreter" in sys.modules:
        from triton_interpreter import patch_once_per_launch

        patch_once_per_launch()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords or "multigpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def fast_paths_unforced(monkeypatch):
    unforce_fast_paths(monkeypatch)


@pytest.fixture(scope="session")
def kernel_cache(tmp_path_factory) -> str:
    """A CPU kernel cache fresh for the session (nothing from an earlier run or version), shared
    by the modules that build the kernels: a build (same sources, compiler and flags) compiles
    and probes once, ~5 s of a core, not once per module."""
    return str(tmp_path_factory.mktemp("kernel_cache"))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """tiny_model(arch, **overrides) -> path of a tiny random HF checkpoint (cached per session)."""
    from moeserve.tools.make_tiny import make_tiny

    cache: dict[tuple, str] = {}

    def build(arch: str, **overrides) -> str:
        key = (arch, tuple(sorted(overrides.items())))
        if key not in cache:
            out = tmp_path_factory.mktemp(f"tiny_{arch}")
            cache[key] = make_tiny(arch, str(out), seed=0, **overrides)
        return cache[key]

    return build
