"""`python -m moeserve.bench.one_batch`: prefill and decode throughput of one static batch.

Prints a table for moeserve's runner and, with --compare-hf, for transformers' `generate` on the same
weights, batch and lengths (random token prompts, greedy, ignore EOS).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import time
from dataclasses import dataclass

import torch

from moeserve.bench.prefill_flops import measure_matmul_peak, prefill_flops
from moeserve.bench.profiling import profile_table
from moeserve.config import compose
from moeserve.bench.roofline import (measure_copy_bandwidth, routed_counts, routing_line,
                                     step_bytes, touched_experts)
from moeserve.core import ForwardMode
from moeserve.forward_batch import ForwardBatch
from moeserve.host_copy import PendingHost
from moeserve.layers.router_skew import routing_hook_name
from moeserve.models.weight_bytes import weight_bytes
from moeserve.runtime.model_runner import ModelRunner
from moeserve.scheduler.prefill import static_prefill_steps


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class DecodeRun:
    """One batch's figures on one path."""

    prefill_tps: float
    decode_tps: float
    step_s: float  # mean decode step
    mean_seq_len: float  # of the requests over the decode steps (KV read per step)
    touched: torch.Tensor | None = None  # [L, P] bool: experts a decode step routed to
    prefill_routed: torch.Tensor | None = None  # [L, P] pairs each expert got in the prefill
    prefill_spread: tuple[float, float] | None = None  # slowest, fastest prefill tok/s (reps > 1)


def bench_moeserve(runner: ModelRunner, batch: int, input_len: int, output_len: int,
                   seed: int = 0, profile: bool = False, count_experts: bool = False,
                   pipelined: bool = True, profile_prefill: bool = False,
                   prefill_reps: int = 1) -> DecodeRun:
    """Prefill then greedy decode of one batch as the server decodes
    (`ModelRunner.forward_greedy`); memory is returned afterwards. `pipelined` (CUDA): as the
    server's forward worker, each step's tokens are read on the host after the next step is
    launched (host_copy.PendingHost); else every step waits for its own tokens. `profile`: also
    print the profiler tables of 3 decode steps (`profile_prefill`: of the prefill, run again
    over the same KV slots). `count_experts`: record which experts one more
    decode step routes to (eager, through the EPLB recorder), and the prefill's pairs per expert
    (the prefill run again over the same KV slots). `prefill_reps`: the prefill is timed that
    many times over the same KV slots and its tok/s is the median's (one timed prefill of a
    4096-token Qwen3 prompt once came out 22% slower than three others on another H100;
    docs/gpu_decode.md)."""
    mem, vocab, dev = runner.memory, runner.hf_config.vocab_size, runner.device
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, input_len), generator=gen).tolist()
    rows = mem.req_to_token.alloc(batch)
    slots = mem.allocator.alloc(batch * (input_len + output_len))
    if rows is None or slots is None:
        raise SystemExit("batch does not fit: raise cache.max_total_tokens / max_running_requests")
    per_req = slots.view(batch, input_len + output_len).to(dev)
    for row, s in zip(rows, per_req):
        mem.req_to_token.write(row, 0, s)
    times = []
    for _ in range(max(prefill_reps, 1)):
        _sync(dev)
        t0 = time.perf_counter()
        next_ids = prefill_chunked(runner, ids, rows, per_req)
        _sync(dev)
        times.append(time.perf_counter() - t0)
    prefill = sorted(times)[len(times) // 2]
    prefill_routed = routed_counts(runner, lambda: prefill_chunked(
        runner, ids, rows, per_req)) if count_experts else None
    if profile_prefill:
        profile_table(f"prefill, batch {batch} x {input_len}", lambda: prefill_chunked(
            runner, ids, rows, per_req), dev, calls=1, rows=30)
    rows_dev = torch.tensor(rows, dtype=torch.int64, device=dev)

    def decode_batch(pos: int) -> ForwardBatch:
        return runner.make_batch(ForwardMode.DECODE, next_ids, [pos] * batch,
                                 per_req[:, pos], rows_dev, [pos] * batch, [1] * batch)

    pipelined = pipelined and dev.type == "cuda"
    pending = None
    t0 = time.perf_counter()
    for step in range(output_len - 1):
        next_ids = runner.forward_greedy(decode_batch(input_len + step))
        # the host needs the tokens of every step, as the server does
        if pipelined:
            started = PendingHost.start(next_ids)
            if pending is not None:
                pending.wait()
            pending = started
        else:
            next_ids.tolist()
    if pending is not None:
        pending.wait()
    _sync(dev)
    decode = time.perf_counter() - t0
    last = input_len + output_len - 1
    if profile:
        profile_table(f"decode step, batch {batch}", lambda: runner.forward_greedy(
            decode_batch(last)), dev, rows=25)
    touched = touched_experts(runner, decode_batch(last)) if count_experts else None
    mem.allocator.free(slots)
    mem.req_to_token.free(rows)
    steps = max(output_len - 1, 1)
    spread = (batch * input_len / max(times), batch * input_len / min(times)) \
        if len(times) > 1 else None
    return DecodeRun(batch * input_len / prefill, batch * (output_len - 1) / max(decode, 1e-9),
                     decode / steps, input_len + 1 + (output_len - 2) / 2, touched,
                     prefill_routed, spread)


def prefill_chunked(runner: ModelRunner, ids: list[list[int]], rows: list[int],
                    per_req: torch.Tensor) -> torch.Tensor:
    """Prefill the prompts `ids` (KV slots per_req [B, >= len]) in the steps the server's
    scheduler would run (scheduler.chunked_prefill_size, static_prefill_steps); → each
    request's first generated token [B] (device)."""
    cfg = runner.cfg
    steps = static_prefill_steps([len(x) for x in ids], cfg.scheduler.chunked_prefill_size,
                                 cfg.cache.page_size)
    first: list[torch.Tensor | None] = [None] * len(ids)
    for step in steps:
        toks, pos, loc, step_rows, prefix, ext = [], [], [], [], [], []
        for i, start, n in step:
            toks += ids[i][start: start + n]
            pos += range(start, start + n)
            loc.append(per_req[i, start: start + n])
            step_rows.append(rows[i])
            prefix.append(start)
            ext.append(n)
        fb = runner.make_batch(ForwardMode.EXTEND, toks, pos, torch.cat(loc), step_rows,
                               prefix, ext)
        out = runner.forward_greedy(fb)
        out.tolist()  # the server reads every step's tokens
        for j, (i, start, n) in enumerate(step):
            if start + n == len(ids[i]):
                first[i] = out[j]
    return torch.stack(first)


@contextlib.contextmanager
def reference_path(runner: ModelRunner):
    """Run `runner` as before the GPU fast path (torch attention, torch experts, torch norms and
    rope, no CUDA graphs) on the same weights and KV memory, for a side-by-side row."""
    from moeserve.attention.torch_backend import TorchAttentionBackend
    from moeserve.layers.fp8_linear import Fp8Linear
    from moeserve.layers.moe import MoEExperts

    # experts and FP8 linears: their torch paths (FP8: dequantize, then matmul)
    experts = [m for m in runner.model.modules() if isinstance(m, (MoEExperts, Fp8Linear))]
    ops = [m for m in runner.model.modules() if getattr(m, "gpu_ops", None) is not None]
    saved = (runner.attn_backend, runner.graph_runner, [e.backend for e in experts],
             runner.extend_graphs)
    runner.attn_backend, runner.graph_runner = TorchAttentionBackend(), None
    runner.extend_graphs = None
    for m in experts:
        m.backend = "torch"
    for m in ops:
        m.gpu_ops = None
    try:
        yield
    finally:
        runner.attn_backend, runner.graph_runner = saved[0], saved[1]
        runner.extend_graphs = saved[3]
        for m, b in zip(experts, saved[2]):
            m.backend = b
        for m in ops:
            m.gpu_ops = runner.gpu_ops


def load_hf(path: str, dtype: torch.dtype, device: torch.device, dummy: bool = False):
    """transformers' model on the same weights (`dummy`: random ones from config.json alone)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if dummy:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype)
        return model.eval()
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


HEADER = (f"| {'path':<12} | {'batch':>5} | {'prefill tok/s':>13} | {'decode tok/s':>12} | "
          f"{'step ms':>8} | {'GB/step':>7} | {'roofline ms':>11} | {'% roofline':>10} |")


def _row(name: str, batch: int, prefill: float, decode: float, step_gb: float | None,
         bw: float | None) -> str:
    step_ms = batch / decode * 1e3 if decode else float("nan")
    if step_gb is None or bw is None:
        return (f"| {name:<12} | {batch:>5} | {prefill:>13.1f} | {decode:>12.1f} | {step_ms:>8.2f} "
                f"| {'-':>7} | {'-':>11} | {'-':>10} |")
    roof_ms = step_gb * 1e9 / bw * 1e3
    return (f"| {name:<12} | {batch:>5} | {prefill:>13.1f} | {decode:>12.1f} | {step_ms:>8.2f} | "
            f"{step_gb:>7.2f} | {roof_ms:>11.2f} | {100 * roof_ms / step_ms:>9.1f}% |")


def _bench_runner(runner: ModelRunner, args, bw: float | None, label: str
                  ) -> tuple[dict[int, float], dict[int, float]]:
    """The table rows of one runner at every batch: (GB per decode step, decode tok/s) by batch.
    `label` names the fast-path rows ("moeserve", or the weight format when comparing)."""
    gb: dict[int, float] = {}
    decode: dict[int, float] = {}
    for b in args.batch:
        paths = [(label, contextlib.nullcontext, True)]
        if args.compare_sync:
            paths.append(("sync steps", contextlib.nullcontext, False))
        if args.compare_reference:
            paths.append(("reference", lambda: reference_path(runner), True))
        for name, ctx, pipelined in paths:
            with ctx():
                for _ in range(args.warmup):
                    bench_moeserve(runner, b, args.input_len, min(args.output_len, 4))
                run = bench_moeserve(runner, b, args.input_len, args.output_len,
                                     profile=args.profile and b == _profiled_batch(args),
                                     profile_prefill=(args.profile_prefill
                                                      and b == _profiled_batch(args)),
                                     count_experts=name == label, pipelined=pipelined,
                                     prefill_reps=args.prefill_reps)
            if run.touched is not None or b not in gb:
                sb = step_bytes(runner, b, run.mean_seq_len, run.touched)
                gb[b] = sb.total / 1e9
                if name == label:
                    print(f"| bytes b={b}: weights {sb.weights / 1e9:.2f} GB + experts "
                          f"{sb.experts / 1e9:.2f} GB ({int(run.touched.sum()) if run.touched is not None else 0} "
                          f"expert-layers) + KV {sb.kv / 1e9:.2f} GB + io {sb.io / 1e9:.3f} GB",
                          flush=True)
            if name == label:
                decode[b] = run.decode_tps
                if run.prefill_routed is not None:
                    print(routing_line(run.prefill_routed, b * args.input_len,
                                       f"prefill routing b={b}"), flush=True)
            print(_row(name, b, run.prefill_tps, run.decode_tps, gb[b], bw), flush=True)
            if name == label and args.peak:
                print(prefill_peak_line(runner, b, args.input_len, run.prefill_tps, args.peak,
                                        run.prefill_spread), flush=True)
    return gb, decode


def prefill_peak_line(runner: ModelRunner, batch: int, input_len: int, tps: float,
                      peak: float, spread: tuple[float, float] | None = None) -> str:
    """Prefill's achieved FLOP/s (bench/prefill_flops.py's count) as a share of `peak`;
    `spread`: the slowest and fastest of the timed prefills (tok/s), whose median `tps` is."""
    flops = prefill_flops(runner, batch, input_len)
    per_token = flops / (batch * input_len)
    share = lambda t: 100 * per_token * t / peak  # noqa: E731
    rate = per_token * tps
    line = (f"| prefill b={batch} x {input_len}: {per_token / 1e9:.2f} GFLOP/token, "
            f"{rate / 1e12:.1f} TFLOP/s = {share(tps):.1f}% of the measured matmul peak "
            f"({peak / 1e12:.0f} TFLOP/s)")
    if spread is not None:
        line += f"; the timed prefills {share(spread[0]):.1f}-{share(spread[1]):.1f}%"
    return line


def _profiled_batch(args) -> int:
    return args.batch[-1] if args.profile_batch is None else args.profile_batch


def _free(dev: torch.device) -> None:
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def _weights_line(runner: ModelRunner) -> str:
    wb = weight_bytes(runner.model)
    parts = ", ".join(f"{k} {v / 1e9:.2f}" for k, v in wb.items() if k not in ("total", "fp8"))
    return (f"| weights on this rank: {wb['total'] / 1e9:.2f} GB (e4m3 {wb['fp8'] / 1e9:.2f}; "
            f"{parts})")


def _speedup_table(decode: dict[str, dict[int, float]]) -> None:
    """Decode tok/s of the first run (e.g. FP8) against another (e.g. bf16), per batch."""
    (fp8, a), (bf16, b) = decode.items()
    print(f"| {'batch':>5} | {fp8 + ' tok/s':>12} | {bf16 + ' tok/s':>12} | {'speedup':>7} |")
    for batch in a:
        print(f"| {batch:>5} | {a[batch]:>12.1f} | {b[batch]:>12.1f} | "
              f"{a[batch] / b[batch]:>6.2f}x |", flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="HF folder; default: the embedded SmolLM2")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--compare-hf", action="store_true", help="add transformers generate rows")
    p.add_argument("--compare-reference", action="store_true",
                   help="add rows of the pre-fast-path run (torch attention/experts, no graphs)")
    p.add_argument("--compare-sync", action="store_true",
                   help="add rows where each step waits for its own tokens before the next")
    p.add_argument("--compare-quantization", action="store_true",
                   help="run as configured (e.g. FP8 from model.quantization=auto|fp8), then "
                        "again with model.quantization=none (bf16), and print the decode speedup")
    p.add_argument("--compare-with", action="append", default=[], metavar="OVERRIDE",
                   help="run again with this extra override (e.g. model.pdl=false; several "
                        "separated by spaces), rows labelled by it, and print the decode "
                        "speedup against it; repeatable")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--prefill-reps", type=int, default=3,
                   help="time the prefill this many times (same KV slots); tok/s of the median")
    p.add_argument("-o", "--override", action="append", default=[])
    p.add_argument("--profile", action="store_true",
                   help="print profiler tables of 3 decode steps at the largest batch")
    p.add_argument("--profile-prefill", action="store_true",
                   help="print profiler tables of one prefill at the largest batch")
    p.add_argument("--profile-batch", type=int, default=None,
                   help="with --profile: profile this batch instead of the largest")
    args = p.parse_args(argv)
    overrides = list(args.override) + ([f"model.path='{args.model}'"] if args.model else [])
    cfg = compose(overrides)
    if cfg.model.path is None:
        from moeserve.models.embedded import embedded_model_path

        path = embedded_model_path()
    else:
        path = cfg.model.path
    runner = ModelRunner(cfg, path)
    dev, dtype = runner.device, runner.dtype
    bw = measure_copy_bandwidth(dev) if dev.type == "cuda" else None
    # the bf16 dense matmul peak (8192^3) of this GPU, measured by this run
    args.peak = measure_matmul_peak(dev) if dev.type == "cuda" else None
    print(f"model={path} device={dev} dtype={dtype} input={args.input_len} "
          f"output={args.output_len} attention={type(runner.attn_backend).__name__} "
          f"cuda_graphs={runner.graph_runner is not None}"
          + (f" copy bandwidth={bw / 1e12:.2f} TB/s (read+write)" if bw else "")
          + (f" bf16 matmul peak={args.peak / 1e12:.0f} TFLOP/s" if args.peak else "")
          + f" prefill chunk={cfg.scheduler.chunked_prefill_size} routing={routing_hook_name()}")
    print(HEADER)
    print("|" + "|".join("-" * len(c) for c in HEADER.split("|")[1:-1]) + "|")
    label = "moeserve"
    if args.compare_quantization:
        label = "fp8" if weight_bytes(runner.model)["fp8"] else str(dtype).replace("torch.", "")
    print(_weights_line(runner), flush=True)
    gb, decode = _bench_runner(runner, args, bw, label)
    if args.compare_quantization:
        del runner
        _free(dev)
        runner = ModelRunner(compose([*overrides, "model.quantization=none"]), path)
        print(_weights_line(runner), flush=True)
        bf16 = str(runner.dtype).replace("torch.", "")
        _, decode_bf16 = _bench_runner(runner, args, bw, bf16)
        _speedup_table({label: decode, bf16: decode_bf16})
    for extra in args.compare_with:
        del runner
        _free(dev)
        runner = ModelRunner(compose([*overrides, *extra.split()]), path)
        print(_weights_line(runner), flush=True)
        _, decode_other = _bench_runner(runner, args, bw, extra)
        _speedup_table({label: decode, extra: decode_other})
        if args.compare_quantization:  # e.g. model.fp8_lm_head=true against bf16
            _speedup_table({extra: decode_other, bf16: decode_bf16})
    if args.compare_hf:
        dummy = cfg.model.load_format == "dummy"
        del runner
        _free(dev)
        hf = load_hf(path, dtype, dev, dummy)
        for b in args.batch:
            if args.warmup:
                bench_hf(hf, dev, b, args.input_len, 4)
            pre, dec = bench_hf(hf, dev, b, args.input_len, args.output_len)
            print(_row("transformers", b, pre, dec, gb.get(b), bw), flush=True)


if __name__ == "__main__":
    main()
