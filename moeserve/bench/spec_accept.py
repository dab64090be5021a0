"""Speculative decoding end to end through the Engine: accept length per chain length and decode
speed with and without speculation, on chat prompts the draft head was not trained on.

    python -m moeserve.bench.spec_accept --draft-path DIR [--model DIR] --steps 1 2 3 4 \
        --max-new-tokens 128 --prompts 8 --concurrency 16 [--repeat 3] [--threads 1] \
        [--trees 2x3 3x2]

Rows: `off` (plain decoding), one per chain length N and one per draft tree (topk K, depth N): batch-1 decode tok/s (requests one at a
time; time to first token excluded via a 1-token run of the same prompt), the accept length
(tokens per verify pass), the share of drafts accepted, and for each --concurrency C the served
tok/s of an engine admitting C requests at a time (cache.max_running_requests=C) given max(2 C,
prompts) requests: several values show the batch size above which speculation stops paying, where
`spec.max_batch_size` should step it aside. The engines take the bench's --override, so
`--override spec.max_batch_size=0` measures speculation everywhere and the default shows the
device's step-aside. Outputs are also checked against plain decoding (greedy: they must be equal).

On a CPU shared with other work, `--repeat R` runs the whole cycle (off, N=...) R times and
reports each row's median speeds, so that a neighbour's burst does not land on one row only;
the load average before and after is printed. `--threads` fixes torch's threads (0: its
default): with a busy neighbour a 2-thread team on 2 cores waits on the busy core.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from moeserve import Engine
from moeserve.engine_api import quote_override


def _chat(eng: Engine, prompts: list[str]) -> list[list[int]]:
    return [eng.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]


def _batch1(eng: Engine, chats: list[list[int]], max_new: int) -> tuple[float, list, list]:
    """Decode tok/s of one request at a time: (total time - prefill-only time) per token."""
    greedy = {"temperature": 0, "max_new_tokens": max_new}
    decode_s, tokens, outs = 0.0, 0, []
    for ids in chats:
        t0 = time.perf_counter()
        eng.generate(input_ids=[ids], sampling_params={**greedy, "max_new_tokens": 1})
        t1 = time.perf_counter()
        eng.scheduler.cache.flush()
        (out,) = eng.generate(input_ids=[ids], sampling_params=greedy)
        t2 = time.perf_counter()
        eng.scheduler.cache.flush()
        decode_s += (t2 - t1) - (t1 - t0)
        tokens += len(out["output_ids"]) - 1
        outs.append(out)
    return tokens / max(decode_s, 1e-9), [o["output_ids"] for o in outs], [o["meta"] for o in outs]


def _served(eng: Engine, chats: list[list[int]], max_new: int, concurrency: int) -> float:
    n = max(2 * concurrency, len(chats))  # requests, through an engine admitting `concurrency`
    prompts = (chats * (n // len(chats) + 1))[:n]
    t0 = time.perf_counter()
    outs = eng.generate(input_ids=prompts, sampling_params={"temperature": 0,
                                                            "max_new_tokens": max_new})
    return sum(len(o["output_ids"]) for o in outs) / (time.perf_counter() - t0)


def _load() -> str:
    return "load %.2f %.2f %.2f" % os.getloadavg()


Config = tuple[int, int, int]  # (num_steps, topk, num_draft_tokens); (0, 1, 0): speculation off
OFF = (0, 1, 0)


def _label(cfg: Config) -> str:
    n, k, w = cfg
    if n == 0:
        return "off"
    return f"N={n}" if k == 1 else f"N={n} tree k={k}" + (f" M={w - 1}" if w else "")


def _run(args, cfg: Config, base: list[str], prompts: list[str]) -> dict:
    n, k, w = cfg
    spec = [] if n == 0 else ["spec.algorithm=nextn", f"spec.num_steps={n}", f"spec.topk={k}",
                              f"spec.num_draft_tokens={w}",
                              f"spec.draft_path={quote_override(args.draft_path)}"]
    with Engine(args.model, base + spec) as eng:
        chats = _chat(eng, prompts)
        tok_s, outs, metas = _batch1(eng, chats, args.max_new_tokens)
    served = []
    for c in args.concurrency:  # an engine admitting c requests at a time
        with Engine(args.model, base + spec + [f"cache.max_running_requests={c}"]) as eng:
            served.append(_served(eng, chats, args.max_new_tokens, c))
    return {"b1": tok_s, "served": served, "outs": outs,
            "verify": sum(m.get("spec_verify_steps", 0) for m in metas),
            "accepted": sum(m.get("spec_accepted_tokens", 0) for m in metas),
            "drafts": sum(m.get("spec_draft_tokens", 0) for m in metas)}


def main(argv: list[str] | None = None) -> None:
    import torch

    from moeserve.spec_mtp.prompts import heldout_prompts

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    p.add_argument("--draft-path", required=True)
    p.add_argument("--steps", type=int, nargs="*", default=[1, 2, 3, 4])
    p.add_argument("--trees", nargs="*", default=[], metavar="KxN[xW]",
                   help="draft-tree rows: topk K, depth N, optionally pruned to W verified "
                   "tokens (spec.num_draft_tokens; e.g. 2x3, 4x3x7)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--concurrency", type=int, nargs="*", default=[16],
                   help="requests in flight of the served runs (one column each; none: only "
                   "the batch-1 column)")
    p.add_argument("--repeat", type=int, default=1, help="cycles over the rows (medians)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--override", action="append", default=[])
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    base = list(args.override)
    prompts = heldout_prompts(args.prompts)
    configs = [OFF] + [(n, 1, 0) for n in args.steps]
    for t in args.trees:
        k, n, *w = (int(x) for x in t.split("x"))
        configs.append((n, k, w[0] if w else 0))
    runs: dict[Config, list[dict]] = {c: [] for c in configs}
    print(f"{_load()}; torch threads {torch.get_num_threads()}", flush=True)
    for rep in range(args.repeat):
        for c in configs:
            r = _run(args, c, base, prompts)
            runs[c].append(r)
            same = r["outs"] == runs[OFF][0]["outs"]
            acc = r["accepted"] / r["verify"] if r["verify"] else None
            print(f"[{rep + 1}/{args.repeat}] {_label(c)}: batch-1 "
                  f"{r['b1']:.1f} tok/s, accept length {acc if acc is None else round(acc, 2)}, "
                  f"served {_tok_s(r['served'])} tok/s, outputs = off: {same}; {_load()}",
                  flush=True)
    _table(args, configs, runs, len(prompts))


def _tok_s(served: list[float]) -> str:
    return " / ".join(f"{s:.1f}" for s in served)


def _table(args, configs: list[Config], runs: dict[Config, list[dict]], n_prompts: int) -> None:
    med = {n: (statistics.median(r["b1"] for r in runs[n]),
               [statistics.median(r["served"][i] for r in runs[n])
                for i in range(len(args.concurrency))]) for n in configs}
    off_b1, off_served = med[OFF]
    print(f"\n{n_prompts} held-out chat prompts, {args.max_new_tokens} new tokens, greedy; "
          f"served: max(2 C, {n_prompts}) requests at C in flight; "
          f"medians of {args.repeat} cycle(s); {_load()}")
    served_cols = "".join(f" served C={c} tok/s | vs off |" for c in args.concurrency)
    print(f"| spec | batch-1 tok/s | vs off | accept length | drafts accepted |{served_cols} "
          "outputs = off |")
    print("|---|---|---|---|---|" + "---|---|" * len(args.concurrency) + "---|")
    for n in configs:
        r0, (b1, served) = runs[n][0], med[n]
        same = all(r["outs"] == runs[OFF][0]["outs"] for r in runs[n])
        acc = f"{r0['accepted'] / r0['verify']:.2f}" if r0["verify"] else "-"
        share = (f"{100 * (r0['accepted'] - r0['verify']) / r0['drafts']:.0f}%"
                 if r0["drafts"] else "-")
        cols = "".join(f" {s:.1f} | {s / o:.2f}x |" for s, o in zip(served, off_served))
        print(f"| {_label(n)} | {b1:.1f} | {b1 / off_b1:.2f}x | {acc} | "
              f"{share} |{cols} {same} |")


if __name__ == "__main__":
    main()
