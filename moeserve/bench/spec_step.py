"""Speculative decoding's step cost: draft chain + verify + draft extend against one plain decode
step, at several batch sizes, side by side in one process.

    python -m moeserve.bench.spec_step --model DIR --batch 1 16 64 --num-steps 3 \
        --accept 2.0 2.5 [--override model.load_format=dummy ...]

DIR: a model with a NextN layer (DeepSeek-V3 shape: `make_random --shape deepseek_v3
--config-only`) or any model with `--override spec.draft_path=dummy` (a random NextN head).
The plain step is timed eager and, on CUDA, replayed from a CUDA graph (the server's plain path);
speculation's passes run eager. A round produces `accept` tokens per request on average, so its
implied speed-up is accept × plain step / round (accept lengths measured elsewhere, e.g. on CPU
with a trained head; random weights accept nothing).
"""

from __future__ import annotations

import argparse
import time

import torch

from moeserve.config import compose
from moeserve.core import ForwardMode, SamplingParams
from moeserve.runtime.model_runner import ModelRunner
from moeserve.runtime.step import ForwardInput
from moeserve.scheduler.worker import ForwardWorker


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _timed(fn, dev: torch.device, reps: int) -> float:
    """Mean seconds of fn() over `reps` runs after two warm-up runs."""
    for _ in range(2):
        fn()
    _sync(dev)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    _sync(dev)
    return (time.perf_counter() - t0) / reps


class Setup:
    """`batch` requests with `context` tokens of (random) KV each, and spare slots for a round."""

    def __init__(self, runner: ModelRunner, batch: int, context: int, width: int):
        mem, dev = runner.memory, runner.device
        self.runner, self.batch, self.context, self.width = runner, batch, context, width
        self.rows = mem.req_to_token.alloc(batch)
        self.slots = mem.allocator.alloc(batch * (context + width))
        if self.rows is None or self.slots is None:
            raise SystemExit("batch does not fit: raise cache.max_total_tokens / "
                             "cache.max_running_requests")
        self.per_req = self.slots.view(batch, context + width).to(dev)
        for row, s in zip(self.rows, self.per_req):
            mem.req_to_token.write(row, 0, s)
        gen = torch.Generator(device=dev).manual_seed(0)
        vocab = runner.hf_config.vocab_size
        table = mem.req_to_token.token_ids
        table[torch.tensor(self.rows, device=dev)] = torch.randint(
            0, vocab, (batch, table.shape[1]), generator=gen, device=dev)
        self.rows_dev = torch.tensor(self.rows, dtype=torch.int64, device=dev)

    def decode_batch(self):
        c, b = self.context, self.batch
        return self.runner.make_batch(ForwardMode.DECODE, torch.zeros(b, dtype=torch.int64),
                                      [c] * b, self.per_req[:, c], self.rows_dev, [c] * b, [1] * b)

    def verify_input(self, num_steps: int) -> ForwardInput:
        c, b, w = self.context, self.batch, num_steps + 1
        greedy = SamplingParams(temperature=0.0)
        return ForwardInput(ForwardMode.TARGET_VERIFY, list(self.rows), [c] * b, [w] * b,
                            self.per_req[:, c : c + w].flatten(), None, [greedy] * b, [None] * b,
                            [-1] * b)

    def free(self) -> None:
        self.runner.memory.allocator.free(self.slots)
        self.runner.memory.req_to_token.free(self.rows)


def bench(runner: ModelRunner, batches: list[int], context: int, num_steps: int,
          accepts: list[float], reps: int) -> list[dict]:
    dev, worker = runner.device, ForwardWorker(runner, threaded=False)
    spec = worker.spec
    graphs = None
    if dev.type == "cuda":
        from moeserve.runtime.cuda_graph import CudaGraphRunner

        graphs = CudaGraphRunner(runner, max(batches))
        graphs.capture()
    rows = []
    for b in batches:
        s = Setup(runner, b, context, num_steps + 1)
        with torch.inference_mode():
            eager = _timed(lambda: runner.forward_greedy(s.decode_batch()).tolist(), dev, reps)
            graph = None
            if graphs is not None:
                def replay():
                    fb = s.decode_batch()
                    return graphs.replay(fb, graphs.bucket_for(b)).argmax(-1).tolist()

                graph = _timed(replay, dev, reps)
            rnd = _timed(lambda: spec.run(s.verify_input(num_steps)), dev, reps)
            fi = s.verify_input(num_steps)
            geo = spec._geometry(fi)
            chain = _timed(lambda: spec._draft_chain(fi, geo).tolist(), dev, reps)
        s.free()
        plain = graph if graph is not None else eager
        rows.append({"batch": b, "plain_eager_ms": eager * 1e3,
                     "plain_graph_ms": None if graph is None else graph * 1e3,
                     "round_ms": rnd * 1e3, "chain_ms": chain * 1e3,
                     "speedups": [a * plain / rnd for a in accepts]})
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--num-steps", type=int, default=3)
    p.add_argument("--accept", type=float, nargs="+", default=[2.0, 2.5])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--override", action="append", default=[])
    args = p.parse_args(argv)
    cfg = compose([f"model.path={args.model}", "spec.algorithm=nextn",
                   f"spec.num_steps={args.num_steps}", "cuda_graph.enabled=false",
                   f"cache.max_running_requests={max(args.batch)}", *args.override])
    runner = ModelRunner(cfg, args.model)
    rows = bench(runner, args.batch, args.context, args.num_steps, args.accept, args.reps)
    print(f"\nspeculative round (draft chain of {args.num_steps - 1} + verify of "
          f"{args.num_steps + 1} tokens + draft extend) vs one plain decode step, context "
          f"{args.context}, draft: {runner.draft.kind}")
    head = ["batch", "plain eager ms", "plain graph ms", "round ms", "of it chain ms"] + [
        f"speed-up @ accept {a}" for a in args.accept]
    print(" | ".join(head))
    for r in rows:
        graph = "-" if r["plain_graph_ms"] is None else f"{r['plain_graph_ms']:.2f}"
        cells = [str(r["batch"]), f"{r['plain_eager_ms']:.2f}", graph, f"{r['round_ms']:.2f}",
                 f"{r['chain_ms']:.2f}"] + [f"{x:.2f}x" for x in r["speedups"]]
        print(" | ".join(cells))


if __name__ == "__main__":
    main()
