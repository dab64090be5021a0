"""The NextN trainer's optimizer loop: learning-rate schedule, the loss, and the resumable Trainer.

The loss is cross-entropy of every chain step against the target's greedy token. Without a draft
vocabulary it scores a candidate set (labels, the target's top-16, random negatives) instead of
the whole vocabulary; with one (draft_vocab.py) it is the exact softmax over the D tokens the
head will score when serving, and labels outside them are ignored (they can never be drafted).
"""

from __future__ import annotations

import math
import os
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F

from moeserve.spec_mtp.draft_vocab import to_draft_index
from moeserve.spec_mtp.training.train_eval import collate
from moeserve.spec_mtp.training.train_head import TrainHead

CHECKPOINT = "checkpoint.pt"


def lr_at(step: int, total: int, base: float, warmup: int) -> float:
    """Linear warmup, then cosine decay to 10% of the base rate at `total`."""
    if step < warmup:
        return base * (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return base * (0.1 + 0.45 * (1 + math.cos(math.pi * frac)))


def candidates(batch, lm_head: torch.Tensor, negatives: int, gen: torch.Generator):
    """Sorted token ids whose logits the loss computes: every label and the target's top-K at
    every position of the batch, plus `negatives` uniformly drawn ids."""
    valid = batch.labels >= 0
    ids = torch.cat([batch.labels[valid], batch.next_topk[valid].flatten(),
                     torch.randint(lm_head.shape[0], (negatives,), generator=gen)])
    return torch.unique(ids)


def step_loss(head: TrainHead, batch, lm_head: torch.Tensor, cfg: dict[str, Any],
              gen: torch.Generator | None = None, vocab: torch.Tensor | None = None):
    """Summed cross-entropy over chain steps (+ optional feature loss); per-step top-1 accuracy
    among the scored tokens. With `vocab` (sorted ids [D]) `lm_head` holds its rows [D, H] and
    the softmax is over them; otherwise cfg["negatives"] None scores the full vocabulary and an
    int only `candidates` (the LM head is 90% of a full-vocabulary step's time on this CPU)."""
    hidden = batch.hidden
    if cfg.get("noise"):  # U(-a, a) times each state's RMS: the head must not rely on exact h
        gen = gen or torch.Generator()
        u = torch.rand(hidden.shape, generator=gen, dtype=hidden.dtype) * 2 - 1
        hidden = hidden + cfg["noise"] * hidden.pow(2).mean(-1, keepdim=True).sqrt() * u
    outs = head.chain(batch.embeds, hidden, cfg["chain_steps"], detach=cfg["detach"],
                      first=int(batch.start.min()))
    loss = torch.zeros(())
    accs = []
    weight, cand = lm_head, None
    if vocab is None and cfg.get("negatives") is not None:
        cand = candidates(batch, lm_head, cfg["negatives"], gen or torch.Generator())
        weight = lm_head[cand]  # [C, H]
    for k, o in enumerate(outs, 1):
        valid = batch.valid(k)
        sel, labels = o[valid], batch.labels[valid]  # [M, H], [M]
        if cand is not None:
            labels = torch.searchsorted(cand, labels)
        elif vocab is not None:
            labels = to_draft_index(labels, vocab)  # -100 outside: ignored, counted wrong
        logits = sel @ weight.T  # [M, V or C or D]
        if bool((labels >= 0).any()):
            loss = loss + F.cross_entropy(logits, labels, ignore_index=-100)
        if cfg["feature_weight"]:
            loss = loss + cfg["feature_weight"] * F.smooth_l1_loss(sel, batch.next_hidden[valid])
        accs.append(float((logits.argmax(-1) == labels).float().mean()))
    return loss, accs


class Trainer:
    """The optimizer loop with its checkpoint: the step count fixes the data cursor (epoch =
    step // batches per epoch, shuffled by seed + epoch), so resuming needs no iterator state."""

    def __init__(self, head: TrainHead, target, records: list[dict], cfg: dict[str, Any],
                 out: str, vocab: torch.Tensor | None = None):
        """`vocab`: the draft vocabulary (sorted ids) the head's softmax is restricted to."""
        self.head, self.target, self.records, self.cfg, self.out = head, target, records, cfg, out
        self.embed = target.get_input_embeddings()
        self.vocab = head.vocab = vocab  # the head's file carries it
        weight = target.get_output_embeddings().weight
        self.lm_head = weight if vocab is None else weight[vocab].contiguous()  # [V or D, H]
        self.opt = torch.optim.AdamW(head.parameters(), lr=cfg["lr"],
                                     weight_decay=cfg["weight_decay"])
        self.step = 0
        self.retune: Any = None  # called every 25 steps (the thread probe)
        self.per_epoch = max(1, len(records) // cfg["batch_size"])

    def cursor(self, step: int) -> tuple[int, int]:
        return step // self.per_epoch, step % self.per_epoch

    def batch_at(self, step: int):
        epoch, i = self.cursor(step)
        gen = torch.Generator().manual_seed(self.cfg["seed"] * 1000 + epoch)
        order = torch.randperm(len(self.records), generator=gen)
        b = self.cfg["batch_size"]
        picked = [self.records[int(k)] for k in order[i * b: (i + 1) * b]]
        return collate(picked, self.embed, self.cfg["prompt_loss"])

    def save_checkpoint(self) -> None:
        state = {"head": self.head.state_dict(), "optimizer": self.opt.state_dict(),
                 "step": self.step, "cursor": self.cursor(self.step), "cfg": self.cfg,
                 "vocab": self.vocab}
        path = os.path.join(self.out, CHECKPOINT)
        torch.save(state, path + ".tmp")
        os.replace(path + ".tmp", path)

    def load_checkpoint(self) -> None:
        self.load_state(torch.load(os.path.join(self.out, CHECKPOINT), weights_only=False))

    def load_state(self, state: dict[str, Any]) -> None:
        if state["cfg"].get("train_records", len(self.records)) != len(self.records):
            raise SystemExit(f"checkpoint was trained on {state['cfg']['train_records']} "
                             f"records, the data cache now gives {len(self.records)}")
        vocab = state.get("vocab")
        if (vocab is None) != (self.vocab is None) or (
                vocab is not None and not torch.equal(vocab, self.vocab)):
            raise SystemExit("checkpoint was trained with another draft vocabulary")
        self.head.load_state_dict(state["head"])
        self.opt.load_state_dict(state["optimizer"])
        self.step, self.cfg = state["step"], state["cfg"]

    def run(self, deadline: float | None) -> None:
        """Train to cfg["total_steps"], shrinking it (checked every 10 steps, timed from after the
        warm-up step) when the projected end passes `deadline`; Ctrl-C saves the checkpoint and
        exits 130."""
        from tqdm import tqdm

        total = self.cfg["total_steps"]
        bar = tqdm(total=total, initial=self.step, desc="train", dynamic_ncols=True)
        avg: list[float] = []
        probe: tuple[float, int] | None = None  # (time, step) after the first (warm-up) step
        try:
            while self.step < self.cfg["total_steps"]:
                loss, accs = self.train_step()
                avg = accs if not avg else [0.9 * a + 0.1 * x for a, x in zip(avg, accs)]
                bar.update(1)
                bar.set_postfix(loss=f"{float(loss):.3f}", acc1=f"{avg[0]:.3f}",
                                acc2=f"{avg[1]:.3f}" if len(avg) > 1 else "-")
                if deadline and probe is None:
                    probe = (time.time(), self.step)
                elif deadline and probe and (self.step - probe[1]) % 10 == 0:
                    self._fit_deadline(probe, deadline, bar)
                if self.step % self.cfg["save_every"] == 0:
                    self.save_checkpoint()
                if self.retune is not None and self.step % 25 == 0:
                    self.retune()
        except KeyboardInterrupt:
            self.save_checkpoint()
            bar.close()
            print(f"\ninterrupted: checkpoint at step {self.step} in {self.out}; "
                  f"continue with --resume", file=sys.stderr)
            raise SystemExit(130)
        bar.close()
        self.save_checkpoint()

    def _fit_deadline(self, probe: tuple[float, int], deadline: float, bar) -> None:
        """Set total_steps to what fits before `deadline` at the pace since `probe`: fewer when
        the steps run slower than planned, more again (up to the planned count, `max_steps`) when
        they speed up, so the budget is neither overrun nor left unused (steps on a shared CPU
        change pace as its neighbours come and go)."""
        per_step = (time.time() - probe[0]) / (self.step - probe[1])
        fit = self.step + int((deadline - time.time()) / per_step)
        cap = self.cfg.setdefault("max_steps", self.cfg["total_steps"])
        total = min(cap, max(self.step, fit))
        if total != self.cfg["total_steps"]:
            self.cfg["total_steps"] = total
            bar.total = total
            bar.set_description(f"train (budget: {per_step:.1f}s/step)")

    def train_step(self):
        self.head.train()
        for group in self.opt.param_groups:
            group["lr"] = lr_at(self.step, self.cfg["total_steps"], self.cfg["lr"],
                                self.cfg["warmup"])
        gen = torch.Generator().manual_seed(self.cfg["seed"] * 7919 + self.step)  # resumable
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.cfg.get("bf16", False)):
            loss, accs = step_loss(self.head, self.batch_at(self.step), self.lm_head, self.cfg,
                                   gen, self.vocab)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.head.parameters(), 1.0)
        self.opt.step()
        self.step += 1
        return loss.detach(), accs
