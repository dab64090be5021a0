"""Speculative decoding end to end through the Engine: accept length per chain length and decode
speed with and without speculation, on chat prompts the draft head was not trained on.

    python -m moeserve.bench.spec_accept --draft-path DIR [--model DIR] --steps 1 2 3 4 \
        --max-new-tokens 128 --prompts 8 --concurrency 16

Rows: `off` (plain decoding) and one per chain length N: batch-1 decode tok/s (requests one at a
time; time to first token excluded via a 1-token run of the same prompt), the accept length
(tokens per verify pass), the share of drafts accepted, and served tok/s with `concurrency`
requests in flight. Outputs are also checked against plain decoding (greedy: they must be equal).
"""

from __future__ import annotations

import argparse
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
    prompts = (chats * (2 * concurrency // len(chats) + 1))[: 2 * concurrency]
    t0 = time.perf_counter()
    outs = eng.generate(input_ids=prompts, sampling_params={"temperature": 0,
                                                            "max_new_tokens": max_new})
    return sum(len(o["output_ids"]) for o in outs) / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> None:
    from moeserve.spec_mtp.prompts import heldout_prompts

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    p.add_argument("--draft-path", required=True)
    p.add_argument("--steps", type=int, nargs="+", default=[1, 2, 3, 4])
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--override", action="append", default=[])
    args = p.parse_args(argv)
    base = [*args.override, f"cache.max_running_requests={max(args.concurrency, 16)}"]
    prompts = heldout_prompts(args.prompts)
    rows, reference = [], None
    for n in [0, *args.steps]:
        spec = [] if n == 0 else ["spec.algorithm=nextn", f"spec.num_steps={n}",
                                  f"spec.draft_path={quote_override(args.draft_path)}"]
        with Engine(args.model, base + spec) as eng:
            chats = _chat(eng, prompts)
            tok_s, outs, metas = _batch1(eng, chats, args.max_new_tokens)
            served = _served(eng, chats, args.max_new_tokens, args.concurrency)
        if n == 0:
            reference = outs
        verify = sum(m.get("spec_verify_steps", 0) for m in metas)
        accepted = sum(m.get("spec_accepted_tokens", 0) for m in metas)
        drafts = sum(m.get("spec_draft_tokens", 0) for m in metas)
        rows.append((("off" if n == 0 else f"N={n}"), tok_s, accepted / verify if verify else None,
                     (accepted - verify) / drafts if drafts else None, served,
                     outs == reference))
        print(f"{rows[-1][0]}: batch-1 {tok_s:.1f} tok/s, accept length "
              f"{rows[-1][2] if rows[-1][2] is None else round(rows[-1][2], 2)}, served "
              f"{served:.1f} tok/s, outputs = off: {rows[-1][5]}", flush=True)
    off_b1, off_served = rows[0][1], rows[0][4]
    print(f"\n{len(prompts)} held-out chat prompts, {args.max_new_tokens} new tokens, greedy; "
          f"served: {2 * args.concurrency} requests at {args.concurrency} in flight")
    print("| spec | batch-1 tok/s | vs off | accept length | drafts accepted | served tok/s | "
          "vs off | outputs = off |")
    print("|---|---|---|---|---|---|---|---|")
    for name, b1, acc, share, served, same in rows:
        acc_s = "-" if acc is None else f"{acc:.2f}"
        share_s = "-" if share is None else f"{100 * share:.0f}%"
        print(f"| {name} | {b1:.1f} | {b1 / off_b1:.2f}x | {acc_s} | {share_s} | {served:.1f} | "
              f"{served / off_served:.2f}x | {same} |")


if __name__ == "__main__":
    main()
