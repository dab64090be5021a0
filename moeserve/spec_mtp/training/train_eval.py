"""Batches for the NextN trainer and the held-out agreement table.

Agreement is measured the way serving uses the head: chains start at every answer position p
(step 1 reads the target's h_p and embed(t_{p+1})), step k feeds the head's own output of step
k-1 back in, and step k is right when its argmax equals the target's greedy token t_{p+k+1}.
With the tokens teacher-forced, step k's inputs are exactly the serving inputs whenever steps
1..k-1 were right, so `P(step k | 1..k-1 right)` is the acceptance rate the verifier sees.

`1 + sum_k P(steps 1..k right)` over every chain start is NOT the served accept length: serving
starts a chain only where the last verify step ended, right after a rejection more often than not,
and misses cluster (a hard stretch of an answer costs several short steps, an easy one is crossed
in a few long ones). The served accept length (tokens per verify step) is the ratio of tokens to
steps along that walk (`served_walk`), which the table reports next to the per-start mean. On
SmolLM2 with the .cache/nextn_s4 head (bench's 8 prompts, N=3): per-start 1.89, walk 1.72,
served 1.72 (the served drafts equal this module's in 547 of 559 verify steps, the rest bf16).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from moeserve.spec_mtp.draft_vocab import to_draft_index
from moeserve.spec_mtp.tree_stats import (Answer, paths_to_json, pruned_tree_accept,
                                          rank_path_counts, walk)


@dataclass
class Batch:
    """Padded head inputs for B sequences of n = L - 1 positions each.

    embeds [B, n, H] = embed(t_{j+1}); hidden [B, n, H] = target h_j; next_hidden [B, n, H] =
    target h_{j+1} (the feature step k should reproduce); labels [B, n] = t_{j+2} (-1: none);
    start [B] = first chain start counted (P - 1 for answers only, 0 with the prompt);
    next_topk [B, n, K] = the target's top tokens after t_{j+1} (training negatives).
    """

    embeds: torch.Tensor
    hidden: torch.Tensor
    next_hidden: torch.Tensor
    labels: torch.Tensor
    start: torch.Tensor
    next_topk: torch.Tensor

    def valid(self, step: int) -> torch.Tensor:
        """[B, n] bool: positions j where chain step `step` has a label and a counted start."""
        n = self.labels.shape[1]
        j = torch.arange(n).unsqueeze(0)
        return (self.labels >= 0) & (j - step + 1 >= self.start.unsqueeze(1))


def collate(records: list[dict[str, Any]], embed: torch.nn.Module,
            prompt_loss: bool = False) -> Batch:
    """Right-padded Batch of records (causal masks keep padding out of real positions)."""
    n = max(len(r["tokens"]) for r in records) - 1
    b, h = len(records), records[0]["hidden"].shape[1]
    tokens = torch.zeros(b, n + 1, dtype=torch.long)
    hidden = torch.zeros(b, n + 1, h)
    labels = torch.full((b, n), -1, dtype=torch.long)
    start = torch.zeros(b, dtype=torch.long)
    k = records[0]["topk"].shape[1] if "topk" in records[0] else 1
    topk = torch.zeros(b, n + 1, k, dtype=torch.long)
    for i, r in enumerate(records):
        length = len(r["tokens"])
        tokens[i, :length] = r["tokens"].long()
        hidden[i, :length] = r["hidden"]
        labels[i, : length - 2] = tokens[i, 2:length]
        start[i] = 0 if prompt_loss else r["prompt_len"] - 1
        if "topk" in r:
            topk[i, :length] = r["topk"].long()
    with torch.no_grad():
        embeds = embed(tokens[:, 1:])
    return Batch(embeds, hidden[:, :-1], hidden[:, 1:], labels, start, topk[:, 1:])


@torch.no_grad()
def chain_correct(head, lm_head: torch.Tensor, batch: Batch, steps: int) -> list[torch.Tensor]:
    """Per step k, [B, n] bool: the head's step-k argmax equals the label at that position (over
    the head's draft vocabulary when it has one, as serving drafts)."""
    vocab = getattr(head, "vocab", None)
    weight = lm_head if vocab is None else lm_head[vocab]  # [V or D, H]
    outs = head.chain(batch.embeds, batch.hidden, steps, first=int(batch.start.min()))
    correct = []
    for o in outs:
        pred = torch.empty(batch.labels.shape, dtype=torch.long)
        flat_o, flat_p = o.reshape(-1, o.shape[-1]), pred.view(-1)
        for i in range(0, flat_o.shape[0], 2048):  # [chunk, V] logits, not [B * n, V]
            idx = (flat_o[i: i + 2048] @ weight.T).argmax(-1)
            flat_p[i: i + 2048] = idx if vocab is None else vocab[idx]
        correct.append(pred == batch.labels)
    return correct


NOT_RANKED = 1 << 40  # label_ranks' rank of a label the draft cannot propose


@torch.no_grad()
def label_ranks(head, lm_head: torch.Tensor, batch: Batch, steps: int) -> list[torch.Tensor]:
    """Per step k, [B, n] long: how many draft logits beat the label's at step k (0: the label
    is the argmax; a label outside the draft vocabulary, or none, ranks past every k)."""
    vocab = getattr(head, "vocab", None)
    weight = lm_head if vocab is None else lm_head[vocab]
    labels = batch.labels
    if vocab is not None:  # label ids -> rows of the draft vocabulary (-1: not in it)
        labels = torch.where(labels >= 0, to_draft_index(labels.clamp(min=0), vocab, -1), -1)
    flat_l = labels.reshape(-1)
    ranks = []
    for o in head.chain(batch.embeds, batch.hidden, steps, first=int(batch.start.min())):
        rank = torch.full(labels.shape, NOT_RANKED, dtype=torch.long)
        flat_o, flat_r = o.reshape(-1, o.shape[-1]), rank.view(-1)
        for i in range(0, flat_o.shape[0], 2048):
            logits, lab = flat_o[i: i + 2048] @ weight.T, flat_l[i: i + 2048]
            own = logits.gather(1, lab.clamp(min=0)[:, None])
            r = (logits > own).sum(1)
            flat_r[i: i + 2048] = torch.where(lab >= 0, r, NOT_RANKED)
        ranks.append(rank)
    return ranks


@torch.no_grad()
def evaluate(head, target, records: list[dict[str, Any]], steps: int = 3,
             batch_size: int = 8, tree_topk: tuple[int, ...] = (),
             tree_nodes: tuple[int, ...] = (), path_ranks: int = 0) -> dict[str, Any]:
    """Chained agreement on `records` (answers only), aggregated over chain starts p whose
    `steps` steps all have labels: per-step, conditional and joint rates, the mean accept length
    over those starts (`accept_length_per_start`), and the accept length serving measures
    (`accept_length`: tokens per verify step of `served_walk` over each answer, N = 1..steps).

    `tree_topk`: per k, the same walk for a full k-ary draft tree (k + k^2 + .. + k^N nodes
    verified at once): a step is accepted when the label is among the draft's top k at every
    step so far (`tree_accept_length[k]`). The path of right tokens feeds the head exactly what
    the tree's node on it would, so this is what such a tree would accept with this head, an
    upper bound for pruned trees.

    `path_ranks` = K > 0: also count the label rank paths (ranks < K, tree_stats.py) into
    `tree_paths`, and for each M in `tree_nodes` the served accept length at N = steps of the
    best M-node tree of ranks < K (`pruned_tree_accept_length`, cross-fitted)."""
    was_training = head.training
    head.eval()
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings().weight
    hits = []  # per chain start: [steps] bool
    walked = [[0, 0] for _ in range(steps)]  # per N: tokens, verify steps
    tree_walked = {k: [[0, 0] for _ in range(steps)] for k in tree_topk}
    answers: list[Answer] = []  # label ranks per answer, for rank paths
    want_ranks = bool(tree_topk) or path_ranks > 0
    for i in range(0, len(records), batch_size):
        batch = collate(records[i: i + batch_size], embed)
        correct = chain_correct(head, lm_head, batch, steps)
        ranks = label_ranks(head, lm_head, batch, steps) if want_ranks else None
        for b in range(batch.labels.shape[0]):
            n_labels = int((batch.labels[b] >= 0).sum())
            last = n_labels - steps  # last start with all labels
            for p in range(int(batch.start[b]), last + 1):
                hits.append(torch.stack([correct[k][b, p + k] for k in range(steps)]))
            if path_ranks:
                answers.append(Answer(int(batch.start[b]), n_labels,
                                      [ranks[k][b].tolist() for k in range(steps)]))
            seqs = [(walked, [correct[k][b].tolist() for k in range(steps)])]
            seqs += [(tree_walked[t], [(ranks[k][b] < t).tolist() for k in range(steps)])
                     for t in tree_topk]
            for acc, seq in seqs:
                for n in range(1, steps + 1):
                    tokens, verify = served_walk(seq, int(batch.start[b]), n_labels, n)
                    acc[n - 1][0] += tokens
                    acc[n - 1][1] += verify
    head.train(was_training)
    h = torch.stack(hits).float() if hits else torch.zeros(0, steps)  # [starts, steps]
    joint = torch.cumprod(h, dim=1)
    rows = []
    for k in range(steps):
        prev = joint[:, k - 1] if k else torch.ones(len(h))
        cond = float((joint[:, k].sum() / prev.sum()) if prev.sum() else 0.0)
        rows.append({"step": k + 1, "agree": float(h[:, k].mean()) if len(h) else 0.0,
                     "given_prev": cond, "joint": float(joint[:, k].mean()) if len(h) else 0.0})
    per_start = [1.0 + sum(r["joint"] for r in rows[: k + 1]) for k in range(steps)]
    def ratio(acc):
        return [t / v if v else 1.0 for t, v in acc]
    out = {"starts": len(h), "rows": rows, "accept_length_per_start": per_start,
           "accept_length": ratio(walked), "verify_steps": [v for _, v in walked],
           "tree_accept_length": {k: ratio(acc) for k, acc in tree_walked.items()}}
    if path_ranks:
        out["tree_paths"] = paths_to_json(rank_path_counts(answers, path_ranks))
        out["pruned_tree_topk"] = path_ranks
        out["pruned_tree_accept_length"] = pruned_tree_accept(answers, path_ranks, steps,
                                                              tree_nodes)
        out["rank_answers"] = answers  # (tree_stats.tree_walk on any shape)
    return out


def served_walk(correct: list[list[bool]], start: int, n_labels: int, n: int) -> tuple[int, int]:
    """(tokens, verify steps) of greedy speculation with `n` drafts over one answer, as served
    (tree_stats.walk). correct[k][j]: chain step k+1 at position j is right (teacher-forced,
    `chain_correct`), i.e. the chain that starts at p = j - k drafts t_{p+k+2}; n_labels: labels
    t_{j+2} exist for j < n_labels."""

    def accepts_at(p: int) -> int:
        a = 0
        while a < n and p + a < n_labels and correct[a][p + a]:
            a += 1
        return a

    return walk(accepts_at, start, n_labels)


def format_table(result: dict[str, Any], extra: dict[str, Any] | None = None) -> str:
    """The agreement table the trainer prints at the end (and --eval-only prints alone)."""
    lines = [f"held-out chained agreement ({result['starts']} chain starts):",
             "| step | agree (teacher-forced tokens) | agree given earlier steps right | "
             "all steps so far right | mean over chain starts: 1 + accepted | "
             "accept length at N=step (tokens per verify step, as served) |",
             "|---|---|---|---|---|---|"]
    for row, per_start, acc in zip(result["rows"], result["accept_length_per_start"],
                                   result["accept_length"]):
        lines.append(f"| {row['step']} | {row['agree']:.3f} | {row['given_prev']:.3f} | "
                     f"{row['joint']:.3f} | {per_start:.2f} | {acc:.2f} |")
    trees = result.get("tree_accept_length") or {}
    if trees:
        steps = len(result["rows"])
        lines += ["full k-ary draft trees (upper bound: the label in the draft's top k at every "
                  "step), accept length as served:",
                  "| k | nodes at N=1.." + str(steps) + " | " +
                  " | ".join(f"N={n}" for n in range(1, steps + 1)) + " |",
                  "|---|---|" + "---|" * steps]
        for k, acc in trees.items():
            nodes = "/".join(str(sum(k ** d for d in range(1, n + 1)))
                             for n in range(1, steps + 1))
            lines.append(f"| {k} | {nodes} | " + " | ".join(f"{a:.2f}" for a in acc) + " |")
    pruned = result.get("pruned_tree_accept_length") or {}
    if pruned:
        k = result["pruned_tree_topk"]
        lines += [f"pruned draft trees (ranks < {k}, depth <= {len(result['rows'])}; the M rank "
                  "paths most often right, cross-fitted over two halves), accept length as "
                  "served:", "| nodes M | " + " | ".join(str(m) for m in pruned) + " |",
                  "|---|" + "---|" * len(pruned),
                  "| accept length | " + " | ".join(f"{a:.2f}" for a in pruned.values()) + " |"]
    for key, value in (extra or {}).items():
        lines.append(f"{key}: {value}")
    return "\n".join(lines)
