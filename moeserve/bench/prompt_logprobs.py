"""What prompt logprobs cost, and what the radix cache can save them: multiple-choice scoring as
evaluation harnesses send it (every choice = a shared context + its continuation), one table.

    python -m moeserve.bench.prompt_logprobs --model DIR --items 32 --context 512 -o device=cuda

Rows (each after a cache flush, the contexts first cached by one plain request each, as a
harness's earlier requests would leave them):
- plain: max_new_tokens 1, no logprobs: prefill with cache hits (the floor);
- echo: logprobs of every prompt token (OpenAI echo + logprobs, max_tokens 0); positions before
  the first asked one are all there is to reuse, so none is: the whole prompt is computed;
- from context: logprobs from the continuation on (/generate's logprob_start_len): the cache
  serves the context up to the token before it;
- echo, no cache: `echo` with the radix cache off: what recomputing costs without any cache.
"""

from __future__ import annotations

import argparse
import gc
import random
import time

import torch

from moeserve import Engine


def workload(items: int, choices: int, context: int, continuation: int, seed: int = 0
             ) -> tuple[list[list[int]], list[list[int]], int]:
    """(contexts, prompts = context + continuation per choice, the continuation's start)."""
    rng = random.Random(seed)
    contexts = [[rng.randrange(100, 20000) for _ in range(context)] for _ in range(items)]
    prompts = [c + [rng.randrange(100, 20000) for _ in range(continuation)]
               for c in contexts for _ in range(choices)]
    return contexts, prompts, context


def timed(eng: Engine, contexts: list[list[int]], prompts: list[list[int]], **kw
          ) -> tuple[float, int]:
    """(seconds for all prompts at once, cached prompt tokens), the contexts cached first."""
    eng.control("flush_cache")
    eng.generate(input_ids=contexts, sampling_params={"max_new_tokens": 1, "temperature": 0})
    t0 = time.perf_counter()
    outs = eng.generate(input_ids=prompts, **kw)
    return time.perf_counter() - t0, sum(o["meta"]["cached_tokens"] for o in outs)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model folder (default: the embedded SmolLM2)")
    ap.add_argument("--items", type=int, default=32)
    ap.add_argument("--choices", type=int, default=4)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--continuation", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3, help="best of this many runs per row")
    ap.add_argument("-o", "--override", nargs="*", default=[], help="Hydra overrides")
    args = ap.parse_args(argv)
    contexts, prompts, start = workload(args.items, args.choices, args.context, args.continuation)
    greedy0 = {"max_new_tokens": 0, "temperature": 0}
    rows = {
        "plain": dict(sampling_params={"max_new_tokens": 1, "temperature": 0}),
        "echo": dict(sampling_params=greedy0, logprob_start_len=0),
        "from context": dict(sampling_params=greedy0, logprob_start_len=start),
    }
    results = {}
    with Engine(args.model, args.override) as eng:
        timed(eng, contexts, prompts, **rows["plain"])  # warm-up
        for name, kw in rows.items():
            results[name] = min((timed(eng, contexts, prompts, **kw) for _ in range(args.repeat)),
                                key=lambda r: r[0])
    gc.collect()  # the first engine's KV pool and graphs, before the second takes its own
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    with Engine(args.model, args.override + ["scheduler.disable_radix_cache=true"]) as eng:
        timed(eng, contexts, prompts, **rows["echo"])
        results["echo, no cache"] = min((timed(eng, contexts, prompts, **rows["echo"])
                                         for _ in range(args.repeat)), key=lambda r: r[0])
    tokens = sum(map(len, prompts))
    print(f"{len(prompts)} prompts ({args.items} contexts of {args.context} tokens x "
          f"{args.choices} continuations of {args.continuation}), {tokens} prompt tokens")
    print(f"{'row':<16}{'seconds':>10}{'prompt tok/s':>14}{'cached tokens':>15}")
    for name, (sec, cached) in results.items():
        print(f"{name:<16}{sec:>10.3f}{tokens / sec:>14.0f}{cached:>15}")


if __name__ == "__main__":
    main()
