"""`python -m moeserve.bench.one_batch`: prefill and decode throughput of one static batch.

Prints a table for moeserve's runner and, with --compare-hf, for transformers' `generate` on the same
weights, batch and lengths (random token prompts, greedy, ignore EOS).
"""

from __future__ import annotations

import argparse
import time

import torch

from moeserve.bench.profiling import profile_table
from moeserve.config import compose
from moeserve.core import ForwardMode
from moeserve.runtime.model_runner import ModelRunner


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_moeserve(runner: ModelRunner, batch: int, input_len: int, output_len: int,
                   seed: int = 0, profile: bool = False) -> tuple[float, float]:
    """→ (prefill tok/s, decode tok/s) for one batch, greedy as the server decodes
    (`ModelRunner.forward_greedy`); memory is returned afterwards. `profile`:
    also print the profiler tables of 3 decode steps at the end."""
    mem, vocab = runner.memory, runner.hf_config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, input_len), generator=gen).tolist()
    rows = mem.req_to_token.alloc(batch)
    slots = mem.allocator.alloc(batch * (input_len + output_len))
    if rows is None or slots is None:
        raise SystemExit("batch does not fit: raise cache.max_total_tokens / max_running_requests")
    per_req = slots.view(batch, input_len + output_len)
    for row, s in zip(rows, per_req):
        mem.req_to_token.write(row, 0, s)
    lens = [input_len] * batch
    fb = runner.make_batch(ForwardMode.EXTEND, [t for x in ids for t in x],
                           list(range(input_len)) * batch, per_req[:, :input_len].flatten(), rows,
                           [0] * batch, lens)
    _sync(runner.device)
    t0 = time.perf_counter()
    next_ids = runner.forward_greedy(fb).tolist()
    _sync(runner.device)
    prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    for step in range(output_len - 1):
        pos = input_len + step
        fb = runner.make_batch(ForwardMode.DECODE, next_ids, [pos] * batch, per_req[:, pos], rows,
                               [pos] * batch, [1] * batch)
        next_ids = runner.forward_greedy(fb).tolist()
    _sync(runner.device)
    decode = time.perf_counter() - t0
    if profile:
        pos = input_len + output_len - 1

        def step():
            fb = runner.make_batch(ForwardMode.DECODE, next_ids, [pos] * batch, per_req[:, pos],
                                   rows, [pos] * batch, [1] * batch)
            runner.forward_greedy(fb)

        profile_table(f"decode step, batch {batch}", step, runner.device, rows=25)
    mem.allocator.free(slots)
    mem.req_to_token.free(rows)
    return batch * input_len / prefill, batch * (output_len - 1) / max(decode, 1e-9)


def load_hf(path: str, dtype: torch.dtype, device: torch.device):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()


def bench_hf(model, device: torch.device, batch: int, input_len: int, output_len: int,
             seed: int = 0) -> tuple[float, float]:
    """transformers generate: prefill = 1-token generate, decode from the difference."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (batch, input_len), generator=gen).to(device)
    kwargs = dict(do_sample=False, min_new_tokens=output_len, pad_token_id=0)
    timings = []
    for n in (1, output_len):
        _sync(device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=n, **{**kwargs, "min_new_tokens": n})
        _sync(device)
        timings.append(time.perf_counter() - t0)
    prefill, total = timings
    return batch * input_len / prefill, batch * (output_len - 1) / max(total - prefill, 1e-9)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="HF folder; default: the embedded SmolLM2")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--compare-hf", action="store_true")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("-o", "--override", action="append", default=[])
    p.add_argument("--profile", action="store_true",
                   help="print profiler tables of 3 decode steps at the largest batch")
    args = p.parse_args(argv)
    overrides = list(args.override) + ([f"model.path='{args.model}'"] if args.model else [])
    cfg = compose(overrides)
    if cfg.model.path is None:
        from moeserve.models.embedded import embedded_model_path

        path = embedded_model_path()
    else:
        path = cfg.model.path
    runner = ModelRunner(cfg, path)
    print(f"model={path} device={runner.device} dtype={runner.dtype} "
          f"input={args.input_len} output={args.output_len}")
    print(f"| {'engine':<12} | {'batch':>5} | {'prefill tok/s':>13} | {'decode tok/s':>12} |")
    print(f"|{'-' * 14}|{'-' * 7}|{'-' * 15}|{'-' * 14}|")
    hf = load_hf(path, runner.dtype, runner.device) if args.compare_hf else None
    for b in args.batch:
        for _ in range(args.warmup):
            bench_moeserve(runner, b, args.input_len, min(args.output_len, 4))
        pre, dec = bench_moeserve(runner, b, args.input_len, args.output_len,
                                  profile=args.profile and b == args.batch[-1])
        print(f"| {'moeserve':<12} | {b:>5} | {pre:>13.1f} | {dec:>12.1f} |", flush=True)
        if hf is not None:
            if args.warmup:
                bench_hf(hf, runner.device, b, args.input_len, 4)
            pre, dec = bench_hf(hf, runner.device, b, args.input_len, args.output_len)
            print(f"| {'transformers':<12} | {b:>5} | {pre:>13.1f} | {dec:>12.1f} |", flush=True)


if __name__ == "__main__":
    main()
