"""`python -m moeserve.bench.extend_step`: one extend (prefill / MIXED) step, graph vs eager.

A served step at high concurrency is a MIXED step: a few prompt chunks plus the running decodes
riding along one token each. This times such steps of T tokens (`--riders` one-token requests
over `--context` cached tokens, the rest prompts of `--prompt-len`) through the extend CUDA
graphs and eagerly, on the same runner, and prints them next to the step's floor: the larger of
its HBM bytes (every weight, all routed experts, the riders' KV) over the measured copy bandwidth
and its FLOPs over `--peak-tflops`.
"""

from __future__ import annotations

import argparse
import time

import torch

from moeserve.bench.roofline import (dense_weight_bytes, expert_bytes, kv_bytes_per_token,
                                     measure_copy_bandwidth)
from moeserve.config import compose
from moeserve.core import ForwardMode
from moeserve.runtime.model_runner import ModelRunner


def _step(runner: ModelRunner, tokens: int, riders: int, context: int, prompt_len: int):
    """A MIXED ForwardBatch of `tokens` tokens (None if it does not fit), with its memory."""
    mem = runner.memory
    prompts = []
    left = tokens - riders
    while left > 0:
        prompts.append(min(prompt_len, left))
        left -= prompts[-1]
    prefix = [0] * len(prompts) + [context] * riders
    lens = prompts + [1] * riders
    rows = mem.req_to_token.alloc(len(lens))
    slots = mem.allocator.alloc(sum(p + n for p, n in zip(prefix, lens)))
    if rows is None or slots is None:
        return None
    offset, new = 0, []
    for row, p, n in zip(rows, prefix, lens):
        mem.req_to_token.write(row, 0, slots[offset: offset + p + n])
        new.append(slots[offset + p: offset + p + n])
        offset += p + n
    vocab = runner.hf_config.vocab_size
    ids = torch.randint(0, vocab, (tokens,)).tolist()
    pos = [i for p, n in zip(prefix, lens) for i in range(p, p + n)]
    mode = ForwardMode.MIXED if riders else ForwardMode.EXTEND
    fb = runner.make_batch(mode, ids, pos, torch.cat(new), rows, prefix, lens)
    return fb, rows, slots


def _time(runner: ModelRunner, fb, iters: int) -> float:
    """Median seconds of `forward_greedy` (host work included, as the server runs it)."""
    times = []
    for _ in range(iters + 2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        runner.forward_greedy(fb).tolist()
        times.append(time.perf_counter() - t0)
    times = sorted(times[2:])
    return times[len(times) // 2]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="HF folder (config.json; dummy weights work)")
    p.add_argument("--tokens", type=int, nargs="+", default=[256, 1024, 1440, 2048])
    p.add_argument("--riders", type=int, default=240, help="one-token decode requests per step")
    p.add_argument("--context", type=int, default=192, help="each rider's cached tokens")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--peak-tflops", type=float, default=790.0, help="bf16 matmul, measured")
    p.add_argument("--profile", action="store_true",
                   help="profiler tables of the largest step, eager (device time per kernel)")
    p.add_argument("-o", "--override", action="append", default=[])
    args = p.parse_args(argv)
    runner = ModelRunner(compose([*args.override, f"model.path='{args.model}'"]), args.model)
    dev = runner.device
    bw = measure_copy_bandwidth(dev)
    cfg = runner.hf_config
    weights = dense_weight_bytes(runner.model)
    experts = runner.moe_parallel.experts_by_layer
    all_experts = expert_bytes(experts, torch.ones(cfg.num_hidden_layers, 4096, dtype=torch.bool))
    elem = torch.empty((), dtype=runner.dtype).element_size()
    top_k = getattr(cfg, "num_experts_per_tok", 0)
    n_exp = next(iter(experts.values())).num_local if experts else 1
    active = (weights + all_experts * top_k / n_exp) / elem  # parameters a token multiplies
    print(f"model={args.model} copy bandwidth={bw / 1e12:.2f} TB/s; weights {weights / 1e9:.2f}"
          f" GB + experts {all_experts / 1e9:.2f} GB; extend graphs: "
          f"{runner.extend_graphs.buckets if runner.extend_graphs else 'off'}")
    print("| tokens | riders | graph ms | eager ms | speedup | floor ms | graph % of floor |")
    print("|---|---|---|---|---|---|---|")
    for t in args.tokens:
        riders = min(args.riders, t - 1)
        made = _step(runner, t, riders, args.context, args.prompt_len)
        if made is None:
            print(f"| {t} | {riders} | does not fit the KV pool |")
            continue
        fb, rows, slots = made
        graphs = runner.extend_graphs
        g = _time(runner, fb, args.iters) if graphs and graphs.bucket_of_step(fb) else None
        runner.extend_graphs = None
        e = _time(runner, fb, args.iters)
        runner.extend_graphs = graphs
        kv = riders * args.context * kv_bytes_per_token(runner.memory.pool)
        floor = max((weights + all_experts + kv) / bw, 2 * active * t / (args.peak_tflops * 1e12))
        gs = f"{g * 1e3:.2f}" if g else "-"
        print(f"| {t} | {riders} | {gs} | {e * 1e3:.2f} | "
              f"{(e / g if g else 1):.2f}x | {floor * 1e3:.2f} | "
              f"{(floor / g * 100 if g else 0):.1f}% |", flush=True)
        if args.profile and t == args.tokens[-1]:
            from moeserve.bench.profiling import profile_table

            runner.extend_graphs = None
            profile_table(f"eager extend step, {t} tokens", lambda: runner.forward_greedy(fb),
                          dev, rows=30)
            runner.extend_graphs = graphs
        runner.memory.allocator.free(slots)
        runner.memory.req_to_token.free(rows)


if __name__ == "__main__":
    main()
