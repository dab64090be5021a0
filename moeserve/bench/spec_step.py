"""Speculative decoding's step cost: draft chain + verify + draft extend against one plain decode
step, at several batch sizes, side by side in one process.

    python -m moeserve.bench.spec_step --model DIR --batch 1 16 64 --num-steps 3 \
        --accept 2.0 2.5 [--override model.load_format=dummy ...]

DIR: a model with a NextN layer (DeepSeek-V3 shape: `make_random --shape deepseek_v3
--config-only`) or any model with `--override spec.draft_path=dummy` (a random NextN head).
The plain step and the round are timed eager and, on CUDA, with the decode CUDA graphs (the
target's decode and verify passes replay them; the draft's one-layer passes run eager). A round produces `accept` tokens per request on average, so its
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
        """Each request's own (random) token at position `context`, the one a verify starts
        from: with one token for all, a MoE model's plain step would route every request to
        the same experts and read a fraction of the expert bytes that real traffic reads."""
        c, b = self.context, self.batch
        ids = self.runner.memory.req_to_token.token_ids[self.rows_dev, c]
        return self.runner.make_batch(ForwardMode.DECODE, ids, [c] * b, self.per_req[:, c],
                                      self.rows_dev, [c] * b, [1] * b)

    def verify_input(self, w: int) -> ForwardInput:
        c, b = self.context, self.batch
        greedy = SamplingParams(temperature=0.0)
        return ForwardInput(ForwardMode.TARGET_VERIFY, list(self.rows), [c] * b, [w] * b,
                            self.per_req[:, c : c + w].flatten(), None, [greedy] * b, [None] * b,
                            [-1] * b)

    def free(self) -> None:
        self.runner.memory.allocator.free(self.slots)
        self.runner.memory.req_to_token.free(self.rows)


def _count_replays(runner: ModelRunner) -> dict[str, int]:
    """Count graph replays of the target's and the draft's graphs from now on (diagnostic: which
    passes of a round replay rather than run eager)."""
    counts = {"target": 0, "draft": 0}
    for name, graphs in (("target", runner.graph_runner), ("draft", runner.draft_graphs)):
        if graphs is None:
            continue
        orig = type(graphs).replay

        def counted(self, *a, _orig=orig, _name=name, **k):
            counts[_name] += 1
            return _orig(self, *a, **k)

        graphs.replay = counted.__get__(graphs)
    return counts


def bench(runner: ModelRunner, batches: list[int], context: int, accepts: list[float],
          reps: int) -> list[dict]:
    dev, worker = runner.device, ForwardWorker(runner, threaded=False)
    spec, graphs = worker.spec, runner.graph_runner
    width = runner.cfg.spec.verify_width  # num_steps + 1, or a draft tree's nodes + 1
    rows = []
    for b in batches:
        s = Setup(runner, b, context, width)

        def plain():
            return runner.forward_greedy(s.decode_batch()).tolist()

        def round_():
            return spec.run(s.verify_input(width))

        with torch.inference_mode():
            runner.graph_runner = None  # eager rows first
            eager, rnd_eager = _timed(plain, dev, reps), _timed(round_, dev, reps)
            runner.graph_runner = graphs
            graph = rnd_graph = None
            if graphs is not None:
                graph = _timed(plain, dev, reps)
                counts = _count_replays(runner)
                rnd_graph = _timed(round_, dev, reps)
                print(f"batch {b}: replays per round: target {counts['target'] / (reps + 2):.1f}, "
                      f"draft {counts['draft'] / (reps + 2):.1f}", flush=True)
            fi = s.verify_input(width)
            geo = spec._geometry(fi)
            chain = _timed(lambda: spec._draft_chain(fi, geo).tolist(), dev, reps)
        s.free()
        plain_s, rnd = (graph, rnd_graph) if graph is not None else (eager, rnd_eager)
        rows.append({"batch": b, "plain_eager_ms": eager * 1e3, "round_eager_ms": rnd_eager * 1e3,
                     "plain_graph_ms": None if graph is None else graph * 1e3,
                     "round_graph_ms": None if rnd_graph is None else rnd_graph * 1e3,
                     "chain_ms": chain * 1e3, "speedups": [a * plain_s / rnd for a in accepts]})
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
                   f"spec.num_steps={args.num_steps}",
                   f"cache.max_running_requests={max(args.batch)}", *args.override])
    runner = ModelRunner(cfg, args.model)
    rows = bench(runner, args.batch, args.context, args.accept, args.reps)
    print(f"\nspeculative round (draft chain of {args.num_steps - 1} + verify of "
          f"{cfg.spec.verify_width} tokens + draft extend, topk {cfg.spec.topk}) vs one plain "
          f"decode step, context "
          f"{args.context}, draft: {runner.draft.kind}")
    head = ["batch", "plain eager ms", "round eager ms", "plain graph ms", "round graph ms",
            "of it chain ms"] + [f"speed-up @ accept {a}" for a in args.accept]
    print("| " + " | ".join(head) + " |")

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    for r in rows:
        cells = [str(r["batch"]), ms(r["plain_eager_ms"]), ms(r["round_eager_ms"]),
                 ms(r["plain_graph_ms"]), ms(r["round_graph_ms"]), ms(r["chain_ms"])] + [
            f"{x:.2f}x" for x in r["speedups"]]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
