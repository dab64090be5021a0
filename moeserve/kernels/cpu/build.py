"""Building the CPU decode kernels (decode.c, linear.c) with the system C compiler (GCC or
clang: the sources use their vector extensions) and loading the first build whose probe passed.

Portability: a build is used only after a run-time probe tried it (probe.py, in a child process,
so an illegal instruction kills the probe and not the server): first the -march=native build,
then (x86-64) an AVX2 + FMA one, then a portable one; the AVX512-BF16 greedy head only where the
probe ran it. Where no compiler is found, every build fails or its probe, `load_cpu_kernels`
returns None (one log line) and the torch ops run instead. MOESERVE_DISABLE_CPU_KERNELS /
_MARCH_NATIVE / _BF16_HEAD force each step off (env.py), so the fallbacks are tested on any CPU.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import logging
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from moeserve.env import env, log_forced_off
from moeserve.kernels.cpu.ops import CpuKernels

logger = logging.getLogger(__name__)

SOURCES = [Path(__file__).with_name("decode.c"), Path(__file__).with_name("linear.c")]
HEADERS = [Path(__file__).with_name("bf16.h")]  # included by the sources: part of the key
CFLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC"]
# threads for ms_linear_w16 (torch's libgomp.so.1 is already loaded, so one OpenMP runtime); a
# compiler without an OpenMP runtime (clang without libomp) builds with the simd pragmas only
OPENMP = (["-fopenmp"], ["-fopenmp-simd"])
NATIVE = ["-march=native"]  # tried first
# then, on x86-64, what an AVX2 machine's -march=native gives the kernels (their v8f vectors are
# one AVX register, FMA in the matmuls), e.g. where the compiler does not know this CPU or the
# native build fails its probe; the portable build (CFLAGS alone: SSE2) last
AVX2 = ["-mavx2", "-mfma", "-mf16c"]
PROBE_TIMEOUT_S = 300.0


def load_cpu_kernels(cache_dir: str, cc: str | None = None) -> CpuKernels | None:
    """The kernels, compiled with `cc` (a command line; default `cc`, else `gcc`, else `clang`)
    into `cache_dir` on first use: the first build that passes its probe of -march=native,
    AVX2 + FMA (x86-64) and portable flags; None without a compiler or when all fail (logged)."""
    e = env()
    return _load(cache_dir, cc, e.disable_cpu_kernels, e.disable_march_native,
                 e.disable_bf16_head)


@functools.cache
def _load(cache_dir: str, cc: str | None, off: bool, no_native: bool,
          no_head: bool) -> CpuKernels | None:
    if off:
        log_forced_off("MOESERVE_DISABLE_CPU_KERNELS", "CPU decode kernels")
        return None
    cc = cc or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        logger.info("no C compiler found: CPU decode kernels off, torch ops instead")
        return None
    if no_native:
        log_forced_off("MOESERVE_DISABLE_MARCH_NATIVE", "the -march=native build")
    for arch in ([] if no_native else [NATIVE]) + _x86_tiers() + [[]]:
        kernels = build_and_probe(cache_dir, shlex.split(cc), arch, no_head)
        if kernels is not None:
            logger.info("CPU decode kernels: the build with %s", " ".join(arch) or "portable flags")
            return kernels
    logger.warning("CPU decode kernels off (no build passed its probe): torch ops instead")
    return None


def _x86_tiers() -> list[list[str]]:
    return [AVX2] if platform.machine().lower() in ("x86_64", "amd64") else []


def build_and_probe(cache_dir: str, cc: list[str], arch: list[str],
                    no_head: bool = False) -> CpuKernels | None:
    """One build (CFLAGS + `arch`), keyed by source, compiler, flags and this CPU's features
    (-march=native code may not run on another CPU), loaded only if its probe passed; the
    probe's verdict is cached next to the library."""
    verdict: dict = {}
    for omp in OPENMP:  # an OpenMP build that fails to build, load or probe: the simd-only one
        flags = [*CFLAGS, *omp, *arch]
        key = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES + HEADERS)
                             + " ".join([*cc, *flags]).encode()
                             + _cpu_features().encode()).hexdigest()[:16]
        target = Path(cache_dir) / "kernels" / f"cpu_decode-{key}.so"
        last = omp is OPENMP[-1]
        if not (target.exists() or _build(cc, flags, target, quiet=not last)):
            continue
        verdict = _probe(target)
        if verdict["kernels"]:
            break
        if not last:  # e.g. OpenMP code without its runtime: undefined __kmpc_* at load
            logger.info("CPU decode kernels built with %s failed their probe (%s): without "
                        "OpenMP threads instead", " ".join(omp), verdict["detail"])
    else:
        if verdict:
            logger.warning("CPU decode kernels built with %s failed their probe: %s",
                           " ".join(arch) or "portable flags", verdict["detail"])
        return None
    head = verdict["bf16_head"]
    if head and no_head:
        log_forced_off("MOESERVE_DISABLE_BF16_HEAD", "the AVX512-BF16 greedy LM head")
        head = False
    elif verdict["detail"]:
        logger.info("AVX512-BF16 greedy LM head off (%s): logits + argmax instead",
                    verdict["detail"])
    try:
        return CpuKernels(ctypes.CDLL(str(target)), bf16_head=head)
    except OSError as e:
        logger.warning("loading the CPU decode kernels (%s) failed: %s", target, e)
        return None


def _probe(target: Path) -> dict:
    """{kernels, bf16_head, detail} of probe.py run on `target` in a child process."""
    cached = target.with_suffix(".probe.json")
    try:
        return json.loads(cached.read_text())
    except (OSError, ValueError):
        pass
    cmd = [sys.executable, "-m", "moeserve.kernels.cpu.probe", str(target)]
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
        out, code, err = run.stdout, run.returncode, run.stderr.strip()
    except subprocess.TimeoutExpired:
        out, code, err = "", None, f"no answer within {PROBE_TIMEOUT_S:.0f} s"
    ok, has_head = "kernels ok" in out, "bf16_head ok" in out
    detail = ""
    if not has_head and "bf16_head absent" not in out:
        why = ("timed out" if code is None else f"killed by {signal_name(-code)}" if code < 0
               else f"exit code {code}")
        last = err.splitlines()[-1] if err else ""
        detail = f"{why}: {last}" if last else why
    verdict = {"kernels": ok, "bf16_head": has_head, "detail": detail}
    if code is None:
        return verdict  # a busy machine may time out: try again next time
    fd, tmp = tempfile.mkstemp(suffix=".json", dir=target.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(verdict, f)
    os.replace(tmp, cached)
    return verdict


def signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def _build(cc: list[str], flags: list[str], target: Path, quiet: bool = False) -> bool:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    cmd = [*cc, *flags, "-o", tmp, *map(str, SOURCES), "-lm"]
    try:
        result = subprocess.run(cmd, capture_output=True, text=True)
        error = result.stderr.strip()[-2000:] if result.returncode else None
    except OSError as e:  # the compiler cannot be run at all
        error = str(e)
    if error is not None:
        os.unlink(tmp)
        (logger.info if quiet else logger.warning)(
            "building the CPU decode kernels failed (%s): %s", " ".join(cmd), error)
        return False
    os.replace(tmp, target)  # atomic: concurrent builders (ranks, tests) never see half a file
    return True


def _cpu_features() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""
