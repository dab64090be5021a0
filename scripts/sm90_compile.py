"""Compile the Triton kernels that CPU tests launch for an H100/H200 (sm90), without a GPU.

Triton's interpreter runs every kernel on CPU, but it neither compiles the kernel for CUDA nor
checks its shared memory: a kernel can pass every interpreter test and still fail to compile, or
ask for more than the H100's 232,448 bytes of shared memory (issue 44's float32 attention did).
Triton's compiler itself needs no GPU, only a target. So:

    # 1. record the launches of some tests (Triton's interpreter, the venv's Triton):
    python scripts/sm90_compile.py record --out launches.json -- tests/kernels/test_fused_moe.py
    # 2. compile each for sm90 with the Triton the GPU image runs (a wheel unpacked elsewhere):
    PYTHONPATH=TRITON36_DIR:. python scripts/sm90_compile.py compile launches.json \
        [--set EXACT_E4M3=False] [--dtype float32=bfloat16]

`compile` prints one row per distinct launch: shared memory against the limit, registers per
thread, the matrix instructions in the SASS (HGMMA/QGMMA: wgmma; HMMA: mma.sync) and
local-memory spills (LDL/STL), or the compile error. Tensor arguments are recorded by dtype
(16-byte aligned, as the caching allocator gives them); integers by value, so the specialization on
divisibility by 16 matches the real launch. What differs from a GPU run: configs chosen on the
host from the device (moe_config tables, `x.is_cuda` switches) are the CPU ones unless `--set`
overrides a constexpr, and the dtypes are the test's (`--dtype` remaps them).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile

SMEM_LIMIT = 232448  # H100/H200 opt-in shared memory per block, bytes


def _describe(v):
    import torch

    if isinstance(v, torch.Tensor):
        return {"tensor": str(v.dtype).removeprefix("torch."), "aligned": v.data_ptr() % 16 == 0}
    if hasattr(v, "base") and type(v).__name__ == "TensorDescriptor":
        return {"descriptor": str(v.base.dtype).removeprefix("torch."), "shape": list(v.shape),
                "strides": list(v.strides), "block": list(v.block_shape)}
    if isinstance(v, bool) or v is None or isinstance(v, (int, float, str)):
        return {"value": v}
    if hasattr(v, "value"):  # tl.constexpr
        return {"value": v.value}
    return {"value": repr(v)}


def record(out: str, pytest_args: list[str]) -> int:
    """Run pytest under the interpreter, writing every distinct kernel launch to `out`."""
    os.environ["TRITON_INTERPRET"] = "1"
    import pytest
    from triton.runtime import interpreter

    seen: dict[str, dict] = {}
    run = interpreter.InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        fn = self.fn
        entry = {"module": fn.__module__, "name": fn.__qualname__,
                 "args": [_describe(a) for a in args],
                 "kwargs": {k: _describe(v) for k, v in kwargs.items()}}
        seen.setdefault(json.dumps(entry, sort_keys=True), entry)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    interpreter.InterpretedFunction.run = recording_run
    try:
        rc = pytest.main(["-n", "0", "-q", "-p", "no:cacheprovider", *pytest_args])
    finally:
        interpreter.InterpretedFunction.run = run
    with open(out, "w") as f:
        json.dump(list(seen.values()), f, indent=1)
    print(f"{len(seen)} distinct launches -> {out}")
    return int(rc)


class _FakeDriver:
    """Enough of Triton's driver for JITFunction.warmup to compile for sm90 without CUDA."""

    def __init__(self, arch: int):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, 32)

    def is_active(self):
        return True

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        import torch

        return torch.device("cpu")


def _sass_counts(cubin: bytes) -> dict[str, int]:
    """Registers per thread, and the count of each instruction of interest in the SASS."""
    import triton.backends.nvidia as nv

    tool = os.path.join(os.path.dirname(nv.__file__), "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
        res = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True,
                             check=True).stdout
    regs = re.search(r"REG:(\d+)", res)
    counts = {"REG": int(regs.group(1)) if regs else -1}
    counts |= {op: len(re.findall(r"\b" + op + r"[.\s]", sass))
               for op in ("HGMMA", "QGMMA", "HMMA", "UTMALDG", "LDL", "STL")}
    return counts


def _arg(d: dict, dtype_map: dict[str, str]):
    import torch
    from triton.runtime.jit import MockTensor

    if "tensor" in d:
        return MockTensor(getattr(torch, dtype_map.get(d["tensor"], d["tensor"])))
    if "descriptor" in d:
        from triton.tools.tensor_descriptor import TensorDescriptor

        base = MockTensor(getattr(torch, dtype_map.get(d["descriptor"], d["descriptor"])))
        return TensorDescriptor(base, d["shape"], d["strides"], d["block"])
    return d["value"]


def compile_launches(path: str, sets: dict[str, object], dtype_map: dict[str, str],
                     arch: int) -> int:
    import triton
    from triton.runtime import driver

    driver.set_active(_FakeDriver(arch))
    with open(path) as f:
        launches = json.load(f)
    done: set[str] = set()
    failed = 0
    print(f"triton {triton.__version__}, sm{arch}, shared-memory limit {SMEM_LIMIT} B")
    for entry in launches:
        kwargs = {k: _arg(v, dtype_map) for k, v in entry["kwargs"].items()}
        kwargs.update({k: v for k, v in sets.items() if k in kwargs})
        args = [_arg(a, dtype_map) for a in entry["args"]]
        key = json.dumps([entry["name"], [str(a) for a in args], sorted(kwargs.items(),
                                                                       key=str)], default=str)
        if key in done:
            continue
        done.add(key)
        consts = ",".join(f"{k}={v}" for k, v in kwargs.items()
                          if isinstance(v, (bool, int)) and (k.isupper() or k.startswith("num_")))
        label = f"{entry['name']} [{consts}]"
        try:
            fn = getattr(importlib.import_module(entry["module"]), entry["name"])
            kernel = fn.warmup(*args, grid=(1,), **kwargs)
            shared = kernel.metadata.shared
            ops = " ".join(f"{k}={v}" for k, v in _sass_counts(kernel.asm["cubin"]).items() if v)
            ok = shared <= SMEM_LIMIT
            failed += not ok
            print(f"{'ok  ' if ok else 'SMEM'} shared {shared:6d} {ops:32s} {label}")
        except Exception as e:  # noqa: BLE001 - report every kernel, then fail
            failed += 1
            msg = str(e).strip().splitlines()
            print(f"FAIL {label}: {type(e).__name__}: {msg[-1] if msg else ''}")
    print(f"{len(done)} kernels compiled, {failed} failed or over the shared-memory limit")
    return 1 if failed else 0


def _parse_value(s: str):
    for conv in (int, float):
        try:
            return conv(s)
        except ValueError:
            pass
    return {"True": True, "False": False}.get(s, s)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record", help="run pytest args under the interpreter, record launches")
    r.add_argument("--out", required=True)
    r.add_argument("pytest_args", nargs="+")
    c = sub.add_parser("compile", help="compile recorded launches for sm90")
    c.add_argument("launches")
    c.add_argument("--set", nargs="*", default=[], metavar="CONST=VALUE",
                   help="override a constexpr/launch option where the kernel takes it")
    c.add_argument("--dtype", nargs="*", default=[], metavar="FROM=TO",
                   help="remap tensor dtypes (e.g. float32=bfloat16)")
    c.add_argument("--arch", type=int, default=90)
    a = p.parse_args(argv)
    if a.cmd == "record":
        return record(a.out, a.pytest_args)
    sets = {k: _parse_value(v) for k, v in (s.split("=", 1) for s in a.set)}
    dtype_map = dict(s.split("=", 1) for s in a.dtype)
    return compile_launches(a.launches, sets, dtype_map, a.arch)


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    sys.exit(main())
