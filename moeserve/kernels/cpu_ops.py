"""The CPU decode kernels of `cpu_decode.c`: built once with the system C compiler (GCC or clang:
the source uses their vector extensions), loaded through ctypes, wrapped with shape and dtype
checks.

Why C and ctypes: each kernel replaces a chain of small torch ops whose dispatch dominated the CPU
decode step of small models; plain C compiles in about a second with no torch headers and no ABI
ties to the installed torch.

Portability: a build is used only after a run-time probe tried it (`cpu_probe`, in a child
process, so an illegal instruction kills the probe and not the server): first the -march=native
build, then (x86-64) an AVX2 + FMA one, then a portable one; the AVX512-BF16 greedy head only
where the probe ran it. Where no
compiler is found, every build fails or its probe, `load_cpu_kernels` returns None (one log line)
and the torch ops run instead. MOESERVE_DISABLE_CPU_KERNELS / _MARCH_NATIVE / _BF16_HEAD force each
step off (env.py), so the fallbacks are tested on any CPU.
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

import torch

from moeserve.env import env, log_forced_off

logger = logging.getLogger(__name__)

SOURCES = [Path(__file__).with_name("cpu_decode.c"), Path(__file__).with_name("cpu_linear.c")]
HEADERS = [Path(__file__).with_name("cpu_bf16.h")]  # included by the sources: part of the key
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
_DT = {torch.float32: 0, torch.bfloat16: 1}

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    "ms_rms_norm": [_P, _P, _P, _I, _P, _P, _I, _I, _F, ctypes.c_int],
    "ms_qk_norm_rope": [_P, _I, _I, _I, _I, _I, _I, _P, _P, _I, _P, _P, _F, ctypes.c_int],
    "ms_decode_attention": [_P, _P, _I, _P, _I, _P, _I, _P, _P, _P, _P, _I, _P, _P, _I, _I, _I,
                            _I, _I, _F, _P, _I, ctypes.c_int],
    "ms_topk_softmax": [_P, _P, _P, _I, _I, _I, ctypes.c_int, ctypes.c_int],
    "ms_moe_experts": [_P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, ctypes.c_int],
    "ms_has_bf16_dot": [],
    "ms_lm_head_argmax": [_P, _P, _P, _I, _I, _I],
    "ms_linear_w16": [_P, _P, _P, _P, _I, _I, _I, _I, ctypes.c_int],
    "ms_linear_w16_fma": [],
}

_RESTYPES = {"ms_qk_norm_rope": _I, "ms_has_bf16_dot": _I, "ms_lm_head_argmax": _I,
             "ms_linear_w16": _I, "ms_linear_w16_fma": _I}


def supports(dtype: torch.dtype) -> bool:
    return dtype in _DT


class CpuKernels:
    """Typed entry points of the compiled library. Every tensor argument is a CPU tensor of the
    call's dtype (float32 or bfloat16) whose rows are contiguous; callers check `supports`."""

    def __init__(self, lib: ctypes.CDLL, bf16_head: bool = False):
        """`bf16_head`: the greedy head passed its probe (it is built only with AVX512-BF16)."""
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, _RESTYPES.get(name)
        self._lib = lib
        self.has_bf16_dot = bf16_head and bool(lib.ms_has_bf16_dot())  # the greedy LM head
        # `linear` built for AVX2 + FMA (elsewhere it runs, slower, on generic vectors)
        self.fast_linear = bool(lib.ms_linear_w16_fma())

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None):
        """RMSNorm of x [T, N] (rows may be strided) as `layers.norm.RMSNorm` computes it; with a
        residual, (norm(x + residual), x + residual)."""
        t, n = x.shape
        assert x.stride(1) == 1 and weight.dtype == x.dtype and weight.is_contiguous()
        out = torch.empty((t, n), dtype=x.dtype)
        res_out = None
        if residual is not None:
            assert residual.is_contiguous() and residual.dtype == x.dtype
            res_out = torch.empty((t, n), dtype=x.dtype)
        self._lib.ms_rms_norm(out.data_ptr(), _ptr(res_out), x.data_ptr(), x.stride(0),
                              _ptr(residual), weight.data_ptr(), t, n, eps, _DT[x.dtype])
        return out if residual is None else (out, res_out)

    def qk_norm_rope(self, qkv: torch.Tensor, num_q: int, num_k: int, head_dim: int,
                     positions: torch.Tensor, table: torch.Tensor, rotary_dim: int,
                     q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                     eps: float) -> None:
        """In place on qkv [T, >= (num_q + num_k) * head_dim]: per-head RMSNorm of the q and k
        heads (when weights are given), then neox rope with `table` [P, 2 * rotary_dim] float32
        (cos | cos | -sin | sin) at each token's position."""
        t = qkv.shape[0]
        assert qkv.stride(1) == 1 and table.dtype == torch.float32 and table.is_contiguous()
        assert positions.dtype == torch.int64 and positions.is_contiguous()
        bad = self._lib.ms_qk_norm_rope(qkv.data_ptr(), t, qkv.stride(0), num_q + num_k, num_q,
                                        head_dim, rotary_dim, positions.data_ptr(),
                                        table.data_ptr(), table.shape[0], _ptr(q_weight),
                                        _ptr(k_weight), eps, _DT[qkv.dtype])
        if bad:
            raise IndexError(f"position {int(positions[bad - 1])} is beyond the rope table "
                             f"({table.shape[0]} positions)")

    def decode_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         loc: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                         table: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor,
                         scaling: float, share: torch.Tensor | None = None) -> torch.Tensor:
        """Stores k/v [B, Hkv, D|Dv] at slots `loc` of k_buf/v_buf [slots, Hkv, D|Dv], then
        attends q [B, H, D] over each request's positions [0, seq_lens[b]) (slots from row
        rows[b] of `table`) → [B, H, Dv], split over torch's intra-op thread count. `share`
        [B] int64: how many leading positions each row shares with the first row of its run (0
        starts a run; a verify pass's rows of one request), read once per run."""
        b, h, d = q.shape
        hkv, dv = v.shape[1], v.shape[2]
        for x in (q, k, v):
            assert x.stride(2) == 1 and x.stride(1) == x.shape[2] and x.dtype == q.dtype
        for x in (k_buf, v_buf):
            assert x.is_contiguous() and x.dtype == q.dtype
        loc, rows, seq_lens = loc.contiguous(), rows.contiguous(), seq_lens.contiguous()
        if share is not None:
            share = share.contiguous()
            assert share.dtype == torch.int64 and share.shape == (b,)
        for x in (loc, table, rows, seq_lens):
            assert x.dtype == torch.int64 and (x.stride(-1) == 1 or x.shape[-1] == 1)
        out = torch.empty((b, h, dv), dtype=q.dtype)
        self._lib.ms_decode_attention(
            out.data_ptr(), q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(),
            v.stride(0), loc.data_ptr(), k_buf.data_ptr(), v_buf.data_ptr(), table.data_ptr(),
            table.stride(0), rows.data_ptr(), seq_lens.data_ptr(), b, h, hkv, d, dv, scaling,
            _ptr(share), torch.get_num_threads(), _DT[q.dtype])
        return out

    def topk_softmax(self, logits: torch.Tensor, k: int, renormalize: bool):
        """logits [T, E] → (weights [T, k] float32, ids [T, k] int64) of the softmax top-k."""
        t, e = logits.shape
        assert logits.is_contiguous()
        weights = torch.empty((t, k), dtype=torch.float32)
        ids = torch.empty((t, k), dtype=torch.int64)
        self._lib.ms_topk_softmax(weights.data_ptr(), ids.data_ptr(), logits.data_ptr(), t, e, k,
                                  int(renormalize), _DT[logits.dtype])
        return weights, ids

    def moe_experts(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                    w13: torch.Tensor, w2: torch.Tensor, first_expert: int) -> torch.Tensor:
        """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) over the experts stacked in w13
        [E, 2I, H] ([gate | up]) and w2 [E, H, I], which hold ids [first_expert, first_expert +
        E); other ids contribute nothing. x [T, H] → [T, H]."""
        t, h = x.shape
        e, two_i, _ = w13.shape
        x, ids = x.contiguous(), ids.contiguous()
        weights = weights.to(torch.float32).contiguous()
        assert w13.is_contiguous() and w2.is_contiguous() and w13.dtype == w2.dtype == x.dtype
        assert ids.dtype == torch.int64 and w2.shape == (e, h, two_i // 2)
        out = torch.empty((t, h), dtype=x.dtype)
        self._lib.ms_moe_experts(out.data_ptr(), x.data_ptr(), ids.data_ptr(), weights.data_ptr(),
                                 w13.data_ptr(), w2.data_ptr(), t, ids.shape[1], h, two_i // 2,
                                 first_expert, e, _DT[x.dtype])
        return out

    def pack_linear(self, weight: torch.Tensor) -> torch.Tensor:
        """A linear weight [N, K] as `linear` reads it: bf16 [ceil(N / 16), K, 16], zero rows
        past N (rounded to bf16 when it is not)."""
        n, k = weight.shape
        padded = torch.zeros((-(-n // 16) * 16, k), dtype=torch.bfloat16)
        padded[:n] = weight
        return padded.view(-1, 16, k).transpose(1, 2).contiguous()

    def linear(self, x: torch.Tensor, packed: torch.Tensor, n: int,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., K] (float32 or bf16) · W^T (+ bias) → [..., n] in x's dtype, from `packed`
        (pack_linear) in float32 arithmetic on torch's intra-op thread count."""
        k = x.shape[-1]
        assert packed.shape[1:] == (k, 16) and packed.dtype == torch.bfloat16
        x2 = x.reshape(-1, k).contiguous()
        if bias is not None:
            assert bias.dtype == x.dtype and bias.is_contiguous()
        out = torch.empty((x2.shape[0], n), dtype=x.dtype)
        if self._lib.ms_linear_w16(out.data_ptr(), x2.data_ptr(), packed.data_ptr(), _ptr(bias),
                                   x2.shape[0], n, k, torch.get_num_threads(), _DT[x.dtype]):
            raise MemoryError(f"ms_linear_w16: no memory for {x2.shape[0]} x {k} activations")
        return out.view(*x.shape[:-1], n)

    def pack_greedy_head(self, weight: torch.Tensor) -> torch.Tensor:
        """An LM head weight [V, H] bf16 in the layout of `greedy_head`: [ceil(V / 16), H / 2,
        16, 2], zero rows past V."""
        v, h = weight.shape
        assert weight.dtype == torch.bfloat16 and h % 2 == 0
        padded = torch.zeros((-(-v // 16) * 16, h), dtype=weight.dtype)
        padded[:v] = weight
        return padded.view(-1, 16, h // 2, 2).transpose(1, 2).contiguous()

    def greedy_head(self, x: torch.Tensor, packed: torch.Tensor, vocab: int) -> torch.Tensor | None:
        """argmax_v of the bf16 logits x · W[v] ([T, H] → [T] int64, first id on ties) without
        writing the logits; None when some logit is NaN (then compute them and take argmax)."""
        t, h = x.shape
        assert self.has_bf16_dot and x.dtype == torch.bfloat16
        assert packed.shape[1:] == (h // 2, 16, 2)
        x = x.contiguous()
        out = torch.empty(t, dtype=torch.int64)
        status = self._lib.ms_lm_head_argmax(out.data_ptr(), x.data_ptr(), packed.data_ptr(),
                                             vocab, h, t)
        return out if status == 0 else None


def _ptr(x: torch.Tensor | None) -> int | None:
    return None if x is None else x.data_ptr()


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
    """{kernels, bf16_head, detail} of `cpu_probe` run on `target` in a child process."""
    cached = target.with_suffix(".probe.json")
    try:
        return json.loads(cached.read_text())
    except (OSError, ValueError):
        pass
    cmd = [sys.executable, "-m", "moeserve.kernels.cpu_probe", str(target)]
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
