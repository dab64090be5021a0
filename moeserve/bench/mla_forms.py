"""`python -m moeserve.bench.mla_forms`: DeepSeek MLA prefill in the absorbed and the MHA form.

Two tables from one runner (docs/mla.md): (1) one extend step of T new tokens (no prefix) in each
form, for the crossover that attention.mla_mha_min_tokens encodes; (2) a batch-1 prompt of each
length prefilled as the server chunks it (scheduler.chunked_prefill_size), in each form: tok/s,
and the share of the bf16 matmul peak this run measures (bench/prefill_flops.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from moeserve.bench.one_batch import prefill_chunked
from moeserve.bench.prefill_flops import measure_matmul_peak, prefill_flops
from moeserve.config import compose
from moeserve.runtime.model_runner import ModelRunner

FORMS = ("absorbed", "mha")


def _time(fn, device: torch.device, reps: int) -> float:
    fn()  # warm-up: Triton compiles, cuBLAS picks its kernels
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def _prefill(runner: ModelRunner, length: int, seed: int = 0):
    """A closure prefilling one random prompt of `length` tokens (memory freed after)."""
    mem = runner.memory
    ids = [torch.randint(0, runner.hf_config.vocab_size, (length,),
                         generator=torch.Generator().manual_seed(seed)).tolist()]

    def run() -> None:
        rows = mem.req_to_token.alloc(1)
        slots = mem.allocator.alloc(length)
        if rows is None or slots is None:
            raise SystemExit("prompt does not fit: raise cache.max_total_tokens")
        per_req = slots.view(1, length).to(runner.device)
        mem.req_to_token.write(rows[0], 0, per_req[0])
        try:
            prefill_chunked(runner, ids, rows, per_req)
        finally:
            mem.allocator.free(slots)
            mem.req_to_token.free(rows)
    return run


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--step-tokens", type=int, nargs="*", default=[64, 128, 256, 512, 1024])
    p.add_argument("--lengths", type=int, nargs="*", default=[512, 4096, 32768])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("-o", "--override", action="append", default=[])
    args = p.parse_args(argv)
    cfg = compose([*args.override, f"model.path='{args.model}'"])
    runner = ModelRunner(cfg, args.model)
    dev = runner.device
    peak = measure_matmul_peak(dev) if dev.type == "cuda" else None
    base = runner.mla_policy
    assert base is not None, "not an MLA model"
    print(f"model={args.model} dtype={runner.dtype} chunk={cfg.scheduler.chunked_prefill_size} "
          f"mha piece={base.chunk_tokens}"
          + (f" bf16 matmul peak={peak / 1e12:.0f} TFLOP/s" if peak else ""), flush=True)

    def timed(form: str, fn) -> float:
        runner.mla_policy = dataclasses.replace(base, form=form)
        return _time(fn, dev, args.reps)

    print("| step tokens | absorbed ms | mha ms | mha speedup |")
    print("|---|---|---|---|")
    for t in args.step_tokens:
        fn = _prefill(runner, t)
        a, m = (timed(f, fn) for f in FORMS)
        print(f"| {t} | {a * 1e3:.2f} | {m * 1e3:.2f} | {a / m:.2f}x |", flush=True)
    print("| prompt | form | prefill tok/s | TFLOP/s | % of peak |")
    print("|---|---|---|---|---|")
    for n in args.lengths:
        flops = prefill_flops(runner, 1, n)
        for form in FORMS:
            try:
                s = timed(form, _prefill(runner, n))
            except torch.OutOfMemoryError:
                print(f"| {n} | {form} | OOM | - | - |", flush=True)
                torch.cuda.empty_cache()
                continue
            pct = f"{100 * flops / s / peak:.1f}%" if peak else "-"
            print(f"| {n} | {form} | {n / s:.0f} | {flops / s / 1e12:.1f} | {pct} |", flush=True)
    runner.mla_policy = base


if __name__ == "__main__":
    main()
