"""Every CPU fast path falls back to torch when its run-time probe says no, on any machine: each
MOESERVE_DISABLE_* variable forces one probe off, a build that crashes is caught by its probe
(child process), and a missing compiler means torch ops; the fallbacks compute what the fast
paths compute (and, in float32, what transformers computes)."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch
from parity import (extend_batch, hf_logits, hf_model, make_runner, prefill_logits,
                    prompts_of_lengths, rel_err)

from moeserve.env import log_forced_off
from moeserve.kernels.cpu import build
from moeserve.kernels.cpu.build import NATIVE, _x86_tiers, build_and_probe, load_cpu_kernels
from moeserve.layers.linear import Linear, onednn_bf16_linear_works

# each test starts with every fast path allowed and forces off the one it tests
pytestmark = pytest.mark.usefixtures("fast_paths_unforced")
CC = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
needs_cc = pytest.mark.skipif(CC is None, reason="no C compiler here")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh kernel cache for this test (children inherit it), so nothing is reused: for the
    tests of building and probing themselves."""
    monkeypatch.setenv("MOESERVE_CACHE_DIR", str(tmp_path))
    return str(tmp_path)


@pytest.fixture
def built(kernel_cache, monkeypatch):
    """The session's kernel cache (conftest: fresh, nothing from an earlier run or version),
    shared by this module's tests of what runs once the kernels are built and by the other
    modules that build them: each build is compiled once, not once a test (a build of decode.c +
    linear.c at -O3 is ~3 s of a core, its probe ~2 s)."""
    monkeypatch.setenv("MOESERVE_CACHE_DIR", kernel_cache)
    return kernel_cache


def test_disable_cpu_kernels_means_none(cache, monkeypatch, caplog):
    monkeypatch.setenv("MOESERVE_DISABLE_CPU_KERNELS", "1")
    log_forced_off.cache_clear()  # logged once per process: a run that sets it logged it already
    with caplog.at_level(logging.INFO):
        assert load_cpu_kernels(cache) is None
    assert "MOESERVE_DISABLE_CPU_KERNELS" in caplog.text


def test_missing_compiler_means_none(cache, caplog):
    """CC pointing at a binary that does not exist: one warning, no kernels, nothing half-built."""
    with caplog.at_level(logging.INFO):
        assert load_cpu_kernels(cache, "/nonexistent/bin/cc") is None
    assert "building the CPU decode kernels failed" in caplog.text
    assert not list((Path(cache) / "kernels").iterdir())


@needs_cc
def test_probe_catches_a_build_that_crashes(cache, tmp_path, monkeypatch, caplog):
    """A library whose code traps when loaded (ud2: SIGILL, as an instruction this CPU lacks
    would): the probe's child dies, the server process does not, and both builds are refused."""
    header = tmp_path / "trap.h"
    header.write_text("__attribute__((constructor)) static void ms_trap(void) "
                      "{ __builtin_trap(); }\n")
    # what the library holds besides the trap does not matter (it dies loading): a one-line
    # source builds in milliseconds, the kernels' sources ~3 s each of the six builds
    source = tmp_path / "one.c"
    source.write_text("int ms_one(void) { return 1; }\n")
    monkeypatch.setattr(build, "SOURCES", [source])
    with caplog.at_level(logging.INFO):
        assert load_cpu_kernels(cache, f"{CC} -include {header}") is None
    # -march=native (unless forced off), AVX2 + FMA (x86-64), then portable; each with OpenMP
    # and then without
    assert caplog.text.count("failed their probe") == 2 * (1 + len(_x86_tiers()) + 1)
    assert "killed by SIG" in caplog.text


@needs_cc
def test_openmp_build_that_cannot_load_falls_back_to_simd_only(cache, tmp_path, caplog):
    """OpenMP code whose runtime is missing (a compiler that accepts -fopenmp but links no
    runtime, as zig's clang does: undefined __kmpc_* symbols at load) fails its probe; the same
    flags without OpenMP threads (-fopenmp-simd, no _OPENMP) are built and used instead."""
    header = tmp_path / "needs_runtime.h"
    header.write_text("#ifdef _OPENMP\nextern void ms_missing_runtime(void);\n"
                      "__attribute__((constructor)) static void ms_needs(void) "
                      "{ ms_missing_runtime(); }\n#endif\n")
    with caplog.at_level(logging.INFO):
        kernels = build_and_probe(cache, [CC, "-include", str(header)], [])
    assert kernels is not None
    assert "without OpenMP threads instead" in caplog.text
    assert "ms_missing_runtime" in caplog.text


@needs_cc
def test_disable_march_native_builds_portable(built, monkeypatch, caplog):
    monkeypatch.setenv("MOESERVE_DISABLE_MARCH_NATIVE", "1")
    log_forced_off.cache_clear()  # it logs once per process
    with caplog.at_level(logging.INFO):
        k = load_cpu_kernels(built)
    assert k is not None and not k.has_bf16_dot  # AVX512-BF16 needs -march flags
    assert "MOESERVE_DISABLE_MARCH_NATIVE" in caplog.text
    native = build_and_probe(built, [CC], NATIVE)
    if native is None:
        pytest.skip("the -march=native build fails its probe here")
    x, w = torch.randn(5, 64), torch.randn(64)
    torch.testing.assert_close(k.rms_norm(x, w, 1e-6), native.rms_norm(x, w, 1e-6))


@needs_cc
def test_disable_bf16_head(built, monkeypatch):
    monkeypatch.setenv("MOESERVE_DISABLE_BF16_HEAD", "1")
    assert not load_cpu_kernels(built).has_bf16_dot


def test_disable_onednn_bf16(monkeypatch):
    monkeypatch.setenv("MOESERVE_DISABLE_ONEDNN_BF16", "1")
    assert not onednn_bf16_linear_works()
    m = Linear(16, 8).to(torch.bfloat16)
    assert not m.pack() and m.packed is None


# ---- whole models: each fallback against the fast path and transformers ------------------------
BF16 = ["model.dtype=bfloat16"]


def _greedy_and_logits(runner, prompts):
    with extend_batch(runner, prompts) as fb:
        logits = runner.forward(fb, float_logits=False)  # [B, V] in the model dtype
        chosen = runner.forward_greedy(fb)
    return logits, chosen


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_no_compiler_runner_matches_transformers(tiny_model, built, monkeypatch, arch):
    """CC missing: the runner runs torch ops (torch attention backend) and equals transformers."""
    monkeypatch.setenv("CC", "/nonexistent/bin/cc")
    path = tiny_model(arch)
    runner = make_runner(path)
    assert runner.cpu_kernels is None and runner.greedy_head is None
    assert type(runner.attn_backend).__name__ == "TorchAttentionBackend"
    ref = hf_model(path)
    prompts = prompts_of_lengths([6, 13], runner.hf_config.vocab_size, seed=7)
    for ours, prompt in zip(prefill_logits(runner, prompts), prompts):
        assert rel_err(ours, hf_logits(ref, prompt)) < 1e-4


@pytest.mark.parametrize("var", ["MOESERVE_DISABLE_CPU_KERNELS", "MOESERVE_DISABLE_MARCH_NATIVE",
                                 "MOESERVE_DISABLE_BF16_HEAD", "MOESERVE_DISABLE_ONEDNN_BF16"])
def test_each_fallback_matches_the_fast_path_bf16(tiny_model, built, monkeypatch, var):
    """bf16 (where every fast path applies): forcing one probe off gives the same greedy tokens
    as the runner with all of them on, logits within bf16 noise; greedy = argmax of the logits."""
    path = tiny_model("qwen3_moe")
    prompts = prompts_of_lengths([12, 5, 9], 30000, seed=5)
    fast = make_runner(path, BF16)
    if onednn_bf16_linear_works():  # preferred to the C bf16-weight linear where it works
        assert all(m.packed is not None and m.w16 is None
                   for m in fast.model.modules() if isinstance(m, Linear))
    fast_logits, fast_ids = _greedy_and_logits(fast, prompts)
    monkeypatch.setenv(var, "1")
    slow = make_runner(path, BF16)
    logits, ids = _greedy_and_logits(slow, prompts)
    if var in ("MOESERVE_DISABLE_CPU_KERNELS", "MOESERVE_DISABLE_BF16_HEAD"):
        assert slow.greedy_head is None
    if var == "MOESERVE_DISABLE_CPU_KERNELS":
        assert slow.cpu_kernels is None
    if var == "MOESERVE_DISABLE_ONEDNN_BF16":
        assert all(m.packed is None for m in slow.model.modules() if isinstance(m, Linear))
    assert torch.equal(ids, logits.float().argmax(-1))
    assert rel_err(logits, fast_logits) < 3e-2
    top2 = fast_logits.float().topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.05  # tokens not decided by bf16 noise
    assert torch.equal(ids[clear], fast_ids[clear])


# ---- bf16 weights with float32 arithmetic (CPUs without native bf16) ----------------------------
@needs_cc
def test_auto_dtype_without_fast_bf16(built, monkeypatch):
    """As on an AVX2-only CPU (oneDNN's bf16 prepack off): model.dtype=auto is bfloat16 where the
    C bf16-weight linear is built for AVX2 + FMA, float32 once it (or every kernel) is off."""
    from moeserve.runtime.model_config import cpu_bf16_is_fast, resolve_dtype

    monkeypatch.delenv("CC", raising=False)  # the compiler found on PATH (needs_cc)
    monkeypatch.setenv("MOESERVE_DISABLE_ONEDNN_BF16", "1")
    kernels = load_cpu_kernels(built)
    assert cpu_bf16_is_fast() == kernels.fast_linear == bool(_x86_tiers())
    assert not cpu_bf16_is_fast(use_cpu_kernels=False)  # model.cpu_kernels=false
    for var, value in (("MOESERVE_DISABLE_CPU_LINEAR", "1"), ("MOESERVE_DISABLE_CPU_KERNELS", "1"),
                       ("CC", "/nonexistent/bin/cc")):
        monkeypatch.setenv(var, value)
        assert resolve_dtype("auto", None, torch.device("cpu")) == torch.float32
        monkeypatch.delenv(var)


@needs_cc
@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_bf16_weight_linear_and_its_fallback(tiny_model, built, monkeypatch, arch):
    """oneDNN off: every bf16 Linear runs the C kernel (its packed weight is the parameter's);
    MOESERVE_DISABLE_CPU_LINEAR=1 on top: torch's bf16 F.linear. Same clear greedy tokens,
    logits within bf16 noise of each other and of transformers in float32, each run's greedy =
    argmax of its logits (no AVX512-BF16 head, as on an AVX2 CPU)."""
    monkeypatch.delenv("CC", raising=False)  # the compiler found on PATH (needs_cc)
    monkeypatch.setenv("MOESERVE_DISABLE_ONEDNN_BF16", "1")
    monkeypatch.setenv("MOESERVE_DISABLE_BF16_HEAD", "1")
    path = tiny_model(arch)
    prompts = prompts_of_lengths([12, 5, 9], 30000, seed=5)
    fast = make_runner(path, BF16)
    if not fast.cpu_kernels.fast_linear:
        pytest.skip("the linear kernel is not built for AVX2 + FMA here")
    linears = [m for m in fast.model.modules() if isinstance(m, Linear)]
    assert linears and all(m.w16 is not None and m.packed is None for m in linears)
    k = linears[0].weight.shape[1]
    assert torch.equal(linears[0].w16.transpose(1, 2).reshape(-1, k)[: linears[0].out_features],
                       linears[0].weight.detach())
    fast_logits, fast_ids = _greedy_and_logits(fast, prompts)
    monkeypatch.setenv("MOESERVE_DISABLE_CPU_LINEAR", "1")
    slow = make_runner(path, BF16)
    assert all(m.w16 is None for m in slow.model.modules() if isinstance(m, Linear))
    logits, ids = _greedy_and_logits(slow, prompts)
    assert torch.equal(ids, logits.float().argmax(-1))
    assert torch.equal(fast_ids, fast_logits.float().argmax(-1))
    assert rel_err(logits, fast_logits) < 3e-2
    top2 = logits.float().topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.05
    assert torch.equal(ids[clear], fast_ids[clear])
    ref = hf_model(path)
    hf_last = torch.stack([hf_logits(ref, p)[-1] for p in prompts])
    assert rel_err(fast_logits, hf_last) < 3e-2 and rel_err(logits, hf_last) < 3e-2
