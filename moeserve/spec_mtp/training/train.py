"""`python -m moeserve.spec_mtp.training`: train a NextN draft head for a model that has none.

    python -m moeserve.spec_mtp.training --out .cache/nextn_smollm2     # embedded SmolLM2
    python -m moeserve.spec_mtp.training --out DIR --resume             # continue after Ctrl-C
    python -m moeserve.spec_mtp.training --out DIR --eval-only          # the agreement table
    python -m moeserve.spec_mtp.training --out DIR --eval-only --tree-topk 2 4  # + trees' bound
    python -m moeserve.spec_mtp.training --out DIR --eval-only --tree-nodes 4 6 8 --save-tree-paths

Self-distillation (train_data.py): the target answers chat prompts greedily (by default the
offline Engine in serving's dtype), one pass of its runner gives the hidden states, both cached in
DIR/data/. The head (train_head.py, loop in train_loop.py) is trained with AdamW (bf16 autocast
where the CPU has native bf16) on chains of `--chain-steps` steps, step 1 on the target's hidden
state and later steps on the head's own previous output, as serving runs it, with its softmax
over a draft vocabulary: the --draft-vocab most frequent tokens of the training answers
(draft_vocab.py). DIR/checkpoint.pt (head, optimizer, step, data cursor) is written every
--save-every steps and on Ctrl-C; the head is written as DIR/model.safetensors + DIR/config.json
for `spec.draft_path=DIR`, and the held-out eval's rank path counts go into config.json
(`tree_paths`: the nodes of pruned draft trees, spec.num_draft_tokens; tree_stats.py).

Choices measured on SmolLM2-135M (held-out step-1 agreement or accept length at N=3 as the table
estimates it; 2-core CPU shared with others, so times are A/B pairs under the same load):
- the draft vocabulary: D=4096 covers ~88% of held-out answer tokens (1024: 76%, 16384: 95%),
  yet restricting a head's argmax to it cost 0.008 of accept length at N=3 (1.634 -> 1.626;
  2048: 1.620, 1024: 1.607): the tokens it lacks are ones the head rarely gets right. It cuts
  the draft pass's LM head 12x when serving; trained with the exact softmax over D;
- bf16 autocast: 2.3-3.4 s per step vs 4.6-5.2 in float32; eager attention over the chain
  mask instead of SDPA: a further ~17%; the Engine generator (bf16, with its runner's hidden
  states) made 51-59 answer tokens/s where transformers' float32 generate made 30-34 on the
  same busy CPU;
- soft labels (cross-entropy against the target's distribution over D) equalled hard labels
  (1.614 vs 1.608 after 100 steps);
- without a draft vocabulary the loss scores labels + the target's top-16 per position + 1024
  random tokens instead of the 49k vocabulary: 0.296 vs 0.292 after 40 steps at 3-4x less time;
- the layer from random init beats a copy of the target's last layer (0.29 vs 0.12 after 40
  steps: the copy starts by predicting t_{j+1} confidently); eh_proj [0 | I] beats a random
  eh_proj (0.36 vs 0.32 at 150 steps); fitting eh_proj by least squares (`--init ridge`)
  starts at 0.31 and stays ~0.01 ahead early, equal after 384 steps (0.479 both);
- gradients through the fed-back outputs (no --detach) are slightly better for step 2
  (0.427 vs 0.409 given step 1 right, 150 steps); --prompt-loss and --feature-weight 1 gave
  no gain (128 and 40 steps); lr 3e-3 was worse than 1e-3;
- 512 and 1024 training prompts were equal at 192 steps, but 6 epochs over 1024 reached
  0.82 train vs 0.49 held-out agreement: past ~3 epochs fresh answers beat repeats, so the
  prompt set has ~3000 and generation may use DATA_SHARE of the budget; 1920 prompts did not beat
  1600 (accept length 1.76 vs 1.80 at N=3, on different machines and dtypes);
- --noise 0.1 (EAGLE's feature noise), same data and 755 steps: 1.75 vs 1.76 at N=3, no gain;
  --weight-decay 0.1 (AdamW), same data and steps: 1.46 / 1.66 / 1.75 at N=1/2/3 against
  1.47 / 1.67 / 1.76, no gain either (its train agreement ended at 0.71); --chain-steps 4,
  same data and steps (1290 s against 948): 1.46 / 1.66 / 1.77, and 1.83 at N=4.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F

from moeserve.env import usable_cpus
from moeserve.spec_mtp.draft_vocab import DEFAULT_SIZE, coverage_table, pick_vocab
from moeserve.spec_mtp.prompts import heldout_prompts, read_prompts, train_prompts
from moeserve.spec_mtp.training import train_data as data
from moeserve.spec_mtp.training.train_eval import evaluate, format_table
from moeserve.spec_mtp.training.train_head import (TrainHead, fit_eh_proj, load_head,
                                                   save_head, write_tree_paths)
from moeserve.spec_mtp.training.train_loop import (  # noqa: F401
    CHECKPOINT, Trainer, lr_at, step_loss)

DATA_SHARE = 0.5  # of --budget-minutes: no new training shard is started after it
# What defines a run: a resumed run takes these from its checkpoint, not from the command line.
RUN_KEYS = ("lr", "batch_size", "seed", "chain_steps", "detach", "feature_weight",
            "prompt_loss", "init", "weight_decay", "warmup", "negatives", "draft_vocab",
            "bf16", "noise")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m moeserve.spec_mtp.training", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: embedded SmolLM2)")
    p.add_argument("--out", required=True, help="output DIR (head, checkpoint, data cache)")
    p.add_argument("--prompts", default=None, help="user messages, one per line or a JSON list")
    p.add_argument("--num-prompts", type=int, default=3200,
                   help="training prompts at most (fewer when the data budget runs out)")
    p.add_argument("--heldout", type=int, default=32, help="held-out prompts for the table")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--generator", choices=("engine", "hf"), default="engine",
                   help="engine: the offline Engine in serving's dtype, then its runner's hidden "
                   "states; hf: transformers generate (float32), hidden states captured on the way")
    p.add_argument("--concurrency", type=int, default=128, help="sequences generated at once")
    p.add_argument("--epochs", type=float, default=6.0,
                   help="passes over the data (the budget usually ends training sooner)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (overrides epochs)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--warmup", type=int, default=20, help="linear warmup steps, then cosine")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    p.add_argument("--chain-steps", type=int, default=3, help="chain steps trained (and shown)")
    p.add_argument("--detach", action="store_true", help="no gradient through fed-back outputs")
    p.add_argument("--feature-weight", type=float, default=0.0,
                   help="weight of a smooth-L1 loss pulling step outputs towards h_{j+1}")
    p.add_argument("--noise", type=float, default=0.0,
                   help="uniform noise on the target's hidden states while training, as a "
                   "fraction of each state's RMS (EAGLE's feature noise; 0: off)")
    p.add_argument("--negatives", type=int, default=1024,
                   help="random extra tokens scored besides labels and the target's top-16 "
                   "(-1: score the full vocabulary)")
    p.add_argument("--draft-vocab", type=int, default=DEFAULT_SIZE,
                   help="the head scores only the D most frequent tokens of the training answers "
                   "(draft_vocab.py; the trainer prints their coverage per D); 0: every token")
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                   help="train with bf16 autocast (default: on where the CPU has native bf16)")
    p.add_argument("--prompt-loss", action="store_true", help="also train on prompt positions")
    p.add_argument("--init", choices=("ridge", "random", "last_layer"), default="ridge",
                   help="ridge: eh_proj fitted by least squares (see fit_eh_proj)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-every", type=int, default=50, help="checkpoint period (steps)")
    p.add_argument("--resume", action="store_true", help="continue from DIR/checkpoint.pt")
    p.add_argument("--eval-only", action="store_true", help="print DIR's held-out table")
    p.add_argument("--tree-topk", type=int, nargs="*", default=[], metavar="K",
                   help="with --eval-only, also the accept length of full K-ary draft trees")
    p.add_argument("--tree-nodes", type=int, nargs="*", default=[4, 6, 8], metavar="M",
                   help="the accept length of the best M-node pruned trees (ranks < "
                   "--tree-path-ranks), reported after training and with --eval-only")
    p.add_argument("--tree-path-ranks", type=int, default=4,
                   help="draft ranks counted in the rank paths written to config.json")
    p.add_argument("--save-tree-paths", action="store_true",
                   help="with --eval-only: write the rank paths into DIR/config.json (training "
                   "always does)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: pick 1 or 2 by a "
                   "probe; on a shared 2-core CPU one thread is often faster)")
    p.add_argument("--budget-minutes", type=float, default=28.0,
                   help="fit training into this wall time for the whole command (0: off)")
    return p.parse_args(argv)


def pick_threads(requested: int) -> int:
    """`requested`, or the faster of 1 and 2 threads on a head-sized matmul (~0.5 s): with
    another process on one of two cores, a 2-thread OpenMP team waits on the busy core and
    measured 2-10x slower than 1 thread. Costs ~0.3 s (2 s on a busy CPU)."""
    if requested > 0:
        torch.set_num_threads(requested)
        return requested
    a, w = torch.randn(256, 576), torch.randn(1536, 576)
    best, best_t = 1, float("inf")
    for n in sorted({1, min(2, usable_cpus())}):
        torch.set_num_threads(n)
        F.linear(a, w)
        t0 = time.perf_counter()
        for _ in range(20):
            F.linear(a, w)
        if time.perf_counter() - t0 < best_t:
            best, best_t = n, time.perf_counter() - t0
    torch.set_num_threads(best)
    return best


def _generator(args, model_path: str, target, tokenizer):
    if args.generator == "engine":
        return data.EngineGenerator(model_path, args.max_new_tokens, args.concurrency)

    def generate(ids):
        pick_threads(args.threads)  # per shard: the CPU's neighbours come and go
        return data.generate_hf(target, tokenizer, ids, args.max_new_tokens, args.concurrency)
    return generate


def build_data(args, model_path: str, target, tokenizer, train: bool = True,
               deadline: float | None = None, max_shards: int | None = None):
    """(train records or None, held-out records), cached in DIR/data/; generation only for
    shards that are missing, and no new training shard once `deadline` has passed."""
    gen = _generator(args, model_path, target, tokenizer)
    prompts = read_prompts(args.prompts) if args.prompts else train_prompts(args.seed)
    held = set(heldout_prompts(None))
    prompts = [p for p in prompts if p not in held][: args.num_prompts]
    try:
        heldout = data.build_split(args.out, "heldout", model_path, target, tokenizer,
                                   heldout_prompts(args.heldout), args.max_new_tokens, gen,
                                   topk=False)
        records = None
        if train:  # the target's top-K: negatives of the candidate loss (no draft vocabulary)
            records = data.build_split(args.out, "train", model_path, target, tokenizer, prompts,
                                       args.max_new_tokens, gen, deadline=deadline,
                                       max_shards=max_shards, topk=not args.draft_vocab)
    finally:
        if hasattr(gen, "close"):
            gen.close()
    return records, heldout


def summary(result: dict, head_dir: str, t_start: float, meta: dict) -> str:
    extra = {"head": head_dir, "trained steps": meta.get("trained_steps"),
             "training prompts / answer tokens": f"{meta.get('prompts')} / {meta.get('tokens')}",
             "wall time of this command": f"{time.time() - t_start:.0f}s"}
    if "tokens_seen" in meta:
        extra["answer tokens trained on (with repeats)"] = meta["tokens_seen"]
    return format_table(result, extra)


def new_cfg(args, n_records: int) -> dict[str, Any]:
    cfg = {k: getattr(args, k) for k in RUN_KEYS} | {"save_every": args.save_every}
    cfg["negatives"] = None if args.negatives < 0 else args.negatives
    if cfg["bf16"] is None:
        from moeserve.runtime.model_config import cpu_has_native_bf16

        cfg["bf16"] = cpu_has_native_bf16()
    per_epoch = max(1, n_records // args.batch_size)
    cfg["total_steps"] = args.steps or max(1, round(args.epochs * per_epoch))
    cfg["train_records"] = n_records
    return cfg


def draft_vocab(size: int, train: list[dict], heldout: list[dict], target, log
                ) -> torch.Tensor | None:
    """The D most frequent tokens of the training answers (None for 0), with the coverage table
    of every D in draft_vocab.LADDER on the training and held-out answers."""
    vocab_size = target.config.vocab_size
    if not size or size >= vocab_size:
        return None
    log(coverage_table(train, heldout, vocab_size, size))
    return pick_vocab(train, size, vocab_size)


def main(argv: list[str] | None = None) -> int:
    t_start = time.time()
    args = parse_args(argv)
    log = print if args.eval_only else (lambda m: print(m, file=sys.stderr))
    log(f"torch threads: {pick_threads(args.threads)}")
    model_path = data.resolve_target(args.model, args.out)
    target, tokenizer = data.load_target(model_path)
    if args.eval_only:
        head, meta = load_head(args.out, target)
        _, heldout = build_data(args, model_path, target, tokenizer, train=False)
        result = evaluate(head, target, heldout, args.chain_steps, tree_topk=tuple(args.tree_topk),
                          tree_nodes=tuple(args.tree_nodes), path_ranks=args.tree_path_ranks)
        if args.save_tree_paths:
            write_tree_paths(args.out, result["tree_paths"], args.tree_path_ranks)
        print(summary(result, args.out, t_start, meta))
        return 0
    torch.manual_seed(args.seed)
    ckpt = os.path.join(args.out, CHECKPOINT)
    state = torch.load(ckpt, weights_only=False) if args.resume and os.path.exists(ckpt) else None
    if args.resume and state is None:
        log("--resume: no checkpoint yet, starting at step 0")
    budget = 60 * args.budget_minutes if args.budget_minutes else None
    data_deadline = t_start + DATA_SHARE * budget if budget and state is None else None
    max_shards = None
    if state is not None:  # the data the checkpoint was trained on, not more
        max_shards = -(-state["cfg"]["train_records"] // data.SHARD_PROMPTS)
    try:
        train, heldout = build_data(args, model_path, target, tokenizer, True, data_deadline,
                                    max_shards)
    except KeyboardInterrupt:
        log(f"\ninterrupted while making data: finished shards stay in {args.out}/data/ and "
            "the next run (with or without --resume) continues from them")
        return 130
    log(f"torch threads: {pick_threads(args.threads)}")  # the neighbours may have changed
    cfg = state["cfg"] if state else new_cfg(args, len(train))
    vocab = draft_vocab(cfg.get("draft_vocab", 0), train, heldout, target, log)
    trainer = Trainer(TrainHead(target, args.init), target, train, cfg, args.out, vocab)
    if not args.threads:
        trainer.retune = lambda: pick_threads(0)
    if state is not None:
        trainer.load_state(state)
        log(f"resumed at step {trainer.step}/{trainer.cfg['total_steps']}")
    elif args.init == "ridge":
        t0 = time.time()
        n = fit_eh_proj(trainer.head, target, train)
        log(f"eh_proj fitted by least squares on {n} positions in {time.time() - t0:.0f}s")
    eval_reserve = 20 + 0.005 * data.supervised_positions(heldout)  # seconds
    deadline = t_start + budget - eval_reserve if budget else None
    trainer.run(deadline)
    tokens = data.supervised_positions(train)
    meta = {"trained_steps": trainer.step, "prompts": len(train), "tokens": tokens}
    save_head(trainer.head, target, args.out, meta)
    meta["tokens_seen"] = round(tokens * trainer.step * trainer.cfg["batch_size"] / len(train))
    result = evaluate(trainer.head, target, heldout, trainer.cfg["chain_steps"],
                      tree_nodes=tuple(args.tree_nodes), path_ranks=args.tree_path_ranks)
    write_tree_paths(args.out, result["tree_paths"], args.tree_path_ranks)
    print(summary(result, args.out, t_start, meta))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
