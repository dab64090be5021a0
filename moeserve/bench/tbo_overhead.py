"""`python -m moeserve.bench.tbo_overhead`: what splitting a step into two-batch-overlap
micro-batches costs on one device (ep_size 1), TBO on and off side by side.

In serving, TBO at ep_size 1 is a no-op (strategy.tbo_active logs it: nothing to overlap). This
bench forces the split anyway: the same step is built and run with ForwardBatch.tbo False (one
batch) and True (two micro-batches through the op-list executor, tbo/strategy.py). There is no
dispatcher (ep_size 1: the experts run in place), so "on" differs from "off" by the split alone:
every kernel launched twice at half the size, two attention-metadata builds and the final concat.
Both run eager (cuda_graph.enabled=false: TBO steps never replay graphs). Rows: a decode step at
each --batch (every request with --context tokens of KV, written by a chunked prefill first) and a
prefill step of --prefill tokens (requests of --prefill-len). Steps alternate off/on in rounds;
the table has the median per step. "same tokens": greedy tokens of on equal to off (bf16 GEMMs of
another row count may round differently, so below 100% is not by itself a bug).

--loopback adds the same rows with `ep.loopback.LoopbackDispatcher` installed: dispatch and
combine copy their tensors, on the dispatcher's side stream when overlapped (CUDA), so one device
runs TBO's whole stream/event path; the logits of "on" must match "on" without a dispatcher.
"floor on/off" is the ratio of the HBM bytes each must move (bench/roofline.py): split, every
dense weight is read by both micro-batches and each reads the routed experts its own tokens went to
(recorded per micro-batch), so where a step is bound by weight bytes (decode, and at one device a
prefill of a few thousand tokens over 128 experts) splitting costs that ratio even with no host
time at all; "on/off" is what was measured.
--trace PATH writes a profiler trace (chrome JSON) of one such TBO decode step and prints how much
of the side stream's busy time ran beside the compute stream's kernels.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from moeserve.bench.roofline import step_bytes, touched_experts
from moeserve.config import compose
from moeserve.core import ForwardMode
from moeserve.runtime.model_runner import ModelRunner
from moeserve.runtime.moe_setup import num_logical_experts
from moeserve.tbo.split import split_batch


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


class Steps:
    """KV rows and slots for `batch` requests of `length` tokens, and steps over them."""

    def __init__(self, runner: ModelRunner, batch: int, length: int, seed: int = 0):
        self.runner, self.batch, self.length = runner, batch, length
        mem = runner.memory
        self.rows = mem.req_to_token.alloc(batch)
        self.slots = mem.allocator.alloc(batch * (length + 1))
        if self.rows is None or self.slots is None:
            raise SystemExit("does not fit: raise cache.max_total_tokens / max_running_requests")
        self.per_req = self.slots.view(batch, length + 1).to(runner.device)
        for row, s in zip(self.rows, self.per_req):
            mem.req_to_token.write(row, 0, s)
        gen = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, runner.hf_config.vocab_size, (batch, length), generator=gen)

    def extend(self, first: int = 0, last: int | None = None):
        """One EXTEND step of requests [first, last), whole prompts: (tbo) -> ForwardBatch."""
        last = self.batch if last is None else last
        n, lens = last - first, [self.length] * (last - first)
        ids = self.ids[first:last].flatten().tolist()
        loc = self.per_req[first:last, : self.length].flatten()
        return lambda tbo: self.runner.make_batch(
            ForwardMode.EXTEND, ids, list(range(self.length)) * n, loc, self.rows[first:last],
            [0] * n, lens, tbo=tbo)

    def decode(self):
        """One DECODE step at position `length` (rewrites the same KV slot each time)."""
        pos, b = self.length, self.batch
        ids = self.ids[:, -1].tolist()
        return lambda tbo: self.runner.make_batch(
            ForwardMode.DECODE, ids, [pos] * b, self.per_req[:, pos], self.rows, [pos] * b,
            [1] * b, tbo=tbo)

    def prefill_kv(self, chunk_tokens: int) -> None:
        per = max(1, chunk_tokens // self.length)
        for first in range(0, self.batch, per):
            self.runner.forward_greedy(self.extend(first, min(self.batch, first + per))(False))

    def free(self) -> None:
        self.runner.memory.allocator.free(self.slots)
        self.runner.memory.req_to_token.free(self.rows)


def time_on_off(runner: ModelRunner, make, iters: int, rounds: int) -> dict[bool, float]:
    """Median ms per step with tbo off / on, alternating in rounds (warmed up first)."""
    dev = runner.device
    times: dict[bool, list[float]] = {False: [], True: []}
    for tbo in (False, True):
        runner.forward_greedy(make(tbo))
    for _ in range(rounds):
        for tbo in (False, True):
            _sync(dev)
            t0 = time.perf_counter()
            for _ in range(iters):
                runner.forward_greedy(make(tbo))
            _sync(dev)
            times[tbo].append((time.perf_counter() - t0) / iters * 1e3)
    return {tbo: statistics.median(ts) for tbo, ts in times.items()}


def same_tokens(runner: ModelRunner, make) -> float:
    off, on = runner.forward_greedy(make(False)), runner.forward_greedy(make(True))
    return (off == on).float().mean().item()


def floor_ratio(runner: ModelRunner, make, seq_len: int) -> float | None:
    """Bytes the split step must move over the unsplit step's (roofline.step_bytes, experts as
    recorded for the whole step and for each micro-batch); None for a model without experts."""
    whole = make(False)
    touched = touched_experts(runner, whole)
    if touched is None:
        return None
    off = step_bytes(runner, whole.batch_size, seq_len, touched).total
    on = sum(step_bytes(runner, part.batch_size, seq_len, touched_experts(runner, part)).total
             for part in split_batch(make(True)) if part.num_tokens)
    return on / off


HEADER = (f"| {'model':<14} | {'dispatcher':<10} | {'step':<8} | {'tokens':>6} | {'off ms':>8} | "
          f"{'on ms':>8} | {'on/off':>7} | {'floor on/off':>12} | {'same tokens':>11} |")


def row(model: str, disp: str, step: str, tokens: int, t: dict[bool, float], floor: float | None,
        same: float) -> str:
    fl = "-" if floor is None else f"{floor:.3f}x"
    return (f"| {model:<14} | {disp:<10} | {step:<8} | {tokens:>6} | {t[False]:>8.3f} | "
            f"{t[True]:>8.3f} | {t[True] / t[False]:>6.3f}x | {fl:>12} | {100 * same:>10.1f}% |")


def loopback(runner: ModelRunner):
    from moeserve.ep.loopback import LoopbackDispatcher

    cfg = runner.hf_config
    return LoopbackDispatcher(runner.mesh, runner.moe_parallel.num_physical(
        num_logical_experts(cfg)), cfg.hidden_size, runner.dtype)


def check_loopback(runner: ModelRunner, make) -> str:
    """Logits of a TBO step with the loopback dispatcher vs without a dispatcher."""
    par = runner.moe_parallel
    saved, par.dispatcher = par.dispatcher, None
    ref = runner.forward(make(True))
    par.dispatcher = loopback(runner)
    try:
        got = runner.forward(make(True))
    finally:
        par.dispatcher = saved
    diff = (got - ref).abs().max().item()
    same = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    return f"max |logit diff| {diff:.3g}, same tokens {100 * same:.1f}%"


def trace_overlap(path: str) -> str:
    """Busy time of the non-main CUDA streams in a chrome trace and the share of it that ran
    while the main (busiest) stream ran a kernel."""
    import json

    with open(path) as f:
        events = json.load(f).get("traceEvents", [])
    spans: dict[int, list[tuple[float, float]]] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            stream = (e.get("args") or {}).get("stream", e.get("tid"))
            spans.setdefault(stream, []).append((e["ts"], e["ts"] + e.get("dur", 0)))
    if len(spans) < 2:
        return f"{len(spans)} CUDA stream(s) in the trace: no side-stream work recorded"
    busy = {s: sum(b - a for a, b in v) for s, v in spans.items()}
    main = max(busy, key=busy.get)
    side = [s for s in spans if s != main]
    total = sum(busy[s] for s in side)
    beside = sum(max(0.0, min(b, d) - max(a, c)) for s in side for a, b in spans[s]
                 for c, d in spans[main])
    parts = ", ".join(f"stream {s}: {len(spans[s])} ops {busy[s]:.0f} us" for s in spans)
    return (f"{parts}; side streams' busy time beside main-stream kernels: "
            f"{100 * beside / max(total, 1e-9):.0f}% of {total:.0f} us")


def write_trace(runner: ModelRunner, make, path: str) -> None:
    from torch.profiler import ProfilerActivity, profile

    par = runner.moe_parallel
    saved, par.dispatcher = par.dispatcher, loopback(runner)
    try:
        runner.forward_greedy(make(True))
        _sync(runner.device)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            runner.forward_greedy(make(True))
            _sync(runner.device)
        prof.export_chrome_trace(path)
    finally:
        par.dispatcher = saved
    print(f"| trace of one TBO decode step with the loopback dispatcher: {path}")
    print(f"| {trace_overlap(path)}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="HF folder (config-only with load_format=dummy)")
    p.add_argument("--name", default=None, help="model label in the table")
    p.add_argument("--batch", type=int, nargs="+", default=[64, 256], help="decode batches")
    p.add_argument("--context", type=int, default=512, help="KV tokens per decoding request")
    p.add_argument("--prefill", type=int, default=4096, help="prefill step tokens (0: none)")
    p.add_argument("--prefill-len", type=int, default=512, help="tokens per prefill request")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--loopback", action="store_true", help="add the loopback-dispatcher rows")
    p.add_argument("--trace", default=None, help="chrome trace of a loopback TBO decode step")
    p.add_argument("--floor-only", action="store_true",
                   help="only the bytes floor column (no timing, the KV left unwritten: which "
                   "experts a step routes to is all the floor needs); e.g. on a CPU")
    p.add_argument("-o", "--override", action="append", default=[])
    args = p.parse_args(argv)
    cfg = compose([f"model.path='{args.model}'", "cuda_graph.enabled=false", *args.override])
    runner = ModelRunner(cfg, args.model)
    name = args.name or args.model.rstrip("/").split("/")[-1]
    print(f"model={args.model} device={runner.device} dtype={runner.dtype} "
          f"attention={type(runner.attn_backend).__name__} ep_size={runner.mesh.ep_size} "
          f"(TBO forced on one device; eager, no CUDA graphs)", flush=True)
    if not args.floor_only:
        print(HEADER)
        print("|" + "|".join("-" * len(c) for c in HEADER.split("|")[1:-1]) + "|", flush=True)
    dispatchers = [("none", None)] + ([("loopback", loopback(runner))] if args.loopback else [])
    with torch.inference_mode():
        cases = [("decode", Steps(runner, b, args.context)) for b in args.batch]
        if not args.floor_only:
            for _, st in cases:
                st.prefill_kv(max(args.prefill, args.context))
        if args.prefill:
            cases.append(("prefill", Steps(runner, max(1, args.prefill // args.prefill_len),
                                           args.prefill_len, seed=1)))
        for kind, st in cases:
            make = st.decode() if kind == "decode" else st.extend()
            tokens = st.batch if kind == "decode" else st.batch * st.length
            floor = floor_ratio(runner, make, st.length + (kind == "decode"))
            if args.floor_only:
                fl = "- (no routed experts)" if floor is None else f"{floor:.3f}x"
                print(f"| {name} | {kind} | {tokens} | floor on/off {fl} |", flush=True)
                continue
            for label, d in dispatchers:
                runner.moe_parallel.dispatcher = d
                t = time_on_off(runner, make, args.iters, args.rounds)
                print(row(name, label, kind, tokens, t, floor, same_tokens(runner, make)),
                      flush=True)
            runner.moe_parallel.dispatcher = None
            if args.loopback:
                print(f"| {kind} {tokens}: loopback TBO vs no-dispatcher TBO: "
                      f"{check_loopback(runner, make)}", flush=True)
        if args.trace:
            kind, st = cases[0]
            write_trace(runner, st.decode(), args.trace)
        for _, st in cases:
            st.free()


if __name__ == "__main__":
    main()
