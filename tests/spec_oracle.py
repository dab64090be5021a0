"""Test drafts for speculative decoding: they replace SpecDecoder's draft chain with proposals
built from a plain run (the oracle), so that accepted blocks of every length occur on tiny random
models whose own draft layers accept almost nothing."""

from __future__ import annotations

import random

import torch

from moeserve import Engine


def oracle_workload(eng: Engine, prompts: list[list[int]], rng: random.Random
                    ) -> tuple[dict[tuple, list[int]], list[dict], list[dict]]:
    """(reference, params, plain): each prompt's plain 24-token continuation (what the oracle
    drafts propose), greedy params with max_new_tokens of every residue mod 4 and, on every
    third prompt, a token of its reference as a stop id, and the plain outputs (with logprobs)
    for those params."""
    greedy = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 24}
    long = eng.generate(input_ids=prompts, sampling_params=greedy)
    reference = {tuple(p): o["output_ids"] for p, o in zip(prompts, long)}
    params = []
    for i, p in enumerate(prompts):
        sp = {"temperature": 0, "max_new_tokens": 5 + i % 4 + rng.randrange(0, 12)}
        if i % 3 == 0:
            sp["stop_token_ids"] = [reference[tuple(p)][rng.randrange(2, 12)]]
        params.append(sp)
    plain = eng.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
    return reference, params, plain


def install_oracle_draft(eng: Engine, reference: dict[tuple, list[int]], corrupt: float,
                         seed: int, alternate: bool = False) -> None:
    """Replace the draft chain by the reference continuation (from the plain run), each token
    replaced by a wrong one with probability `corrupt` (`alternate`: every other round is all
    wrong, the others all right)."""
    decoder, sched = eng.scheduler.worker.spec, eng.scheduler
    vocab, n, rng = eng.runner.hf_config.vocab_size, decoder.n, random.Random(seed)
    rounds = [0]

    def chain(fi, geo):
        by_row = {r.req_pool_idx: r for r in sched.running}
        drafts = []
        rounds[0] += 1
        wrong = 1.0 if rounds[0] % 2 else 0.0
        for row, start in zip(fi.rows, fi.prefix_lens):
            req = by_row[row]
            full = req.input_ids + reference[tuple(req.input_ids)]
            d = [full[start + 1 + i] if start + 1 + i < len(full) else 0 for i in range(n)]
            p = wrong if alternate else corrupt
            drafts.append([(t + 1) % vocab if rng.random() < p else t for t in d])
        return torch.tensor(drafts, dtype=torch.int64, device=geo[0].device)

    decoder._draft_chain = chain


def install_mode_draft(eng: Engine, modes: list[int]) -> None:
    """Drafts = the most frequent plain-run token at each output position: the target gives them
    a large probability, so both acceptance and rejection are frequent."""
    decoder, sched = eng.scheduler.worker.spec, eng.scheduler

    def chain(fi, geo):
        by_row = {r.req_pool_idx: r for r in sched.running}
        drafts = [[modes[min(start + 1 + i - len(by_row[row].input_ids), len(modes) - 1)]
                   for i in range(decoder.n)] for row, start in zip(fi.rows, fi.prefix_lens)]
        return torch.tensor(drafts, dtype=torch.int64, device=geo[0].device)

    decoder._draft_chain = chain


def install_oracle_tree(eng: Engine, reference: dict[tuple, list[int]], corrupt: float,
                        seed: int) -> None:
    """A draft tree (spec.topk > 1) around the reference continuation: at every node on the
    reference path one child, in a random place among the k, is the next reference token (a wrong
    one with probability `corrupt`); every other child is a distinct wrong token."""
    decoder, sched = eng.scheduler.worker.spec, eng.scheduler
    vocab, shape, rng = eng.runner.hf_config.vocab_size, decoder.shape, random.Random(seed)

    def chain(fi, geo):
        by_row = {r.req_pool_idx: r for r in sched.running}
        trees = []
        for row, start in zip(fi.rows, fi.prefix_lens):
            req = by_row[row]
            full = req.input_ids + reference[tuple(req.input_ids)]
            tokens = [0] * (shape.nodes + 1)
            on_ref = {0: True}  # node -> whether the path to it is the reference
            for d in range(1, shape.depth + 1):
                nxt = full[start + d] if start + d < len(full) else 0
                for parent in shape.level(d - 1):
                    kids = shape.children(parent)
                    if not kids:
                        continue
                    right = rng.randrange(len(kids)) if on_ref[parent] else -1
                    taken = {nxt}
                    for j, child in enumerate(kids):
                        good = j == right and rng.random() >= corrupt
                        if good:
                            tokens[child] = nxt
                        else:
                            t = rng.randrange(vocab)
                            while t in taken:
                                t = rng.randrange(vocab)
                            taken.add(t)
                            tokens[child] = t
                        on_ref[child] = good
            trees.append(tokens)
        return torch.tensor(trees, dtype=torch.int64, device=geo[0].device)

    decoder._draft_chain = chain


def install_ranked_tree(eng: Engine, ranked: list[list[int]]) -> None:
    """A draft tree whose children at output position j are the plain run's k most frequent
    tokens there, most frequent first: both the first and the later children are often right."""
    decoder, sched = eng.scheduler.worker.spec, eng.scheduler
    shape = decoder.shape

    def chain(fi, geo):
        by_row = {r.req_pool_idx: r for r in sched.running}
        trees = []
        for row, start in zip(fi.rows, fi.prefix_lens):
            first = start + 1 - len(by_row[row].input_ids)  # output index of depth 1
            tokens = [0] * (shape.nodes + 1)
            for d in range(1, shape.depth + 1):
                cands = ranked[min(first + d - 1, len(ranked) - 1)]
                for child in shape.level(d):
                    tokens[child] = cands[shape.rank[child]]
            trees.append(tokens)
        return torch.tensor(trees, dtype=torch.int64, device=geo[0].device)

    decoder._draft_chain = chain


def assert_same_distribution(samples: dict[str, list[list[int]]], positions: int = 3) -> None:
    """Chi-squared homogeneity of the two runs' tokens at each output position (p > 1e-3),
    tokens seen fewer than 10 times in both pooled into one column."""
    from scipy.stats import chi2_contingency

    for pos in range(positions):
        tokens = sorted({s[pos] for v in samples.values() for s in v})
        table = [[sum(s[pos] == t for s in samples[k]) for t in tokens] for k in samples]
        keep = [j for j in range(len(tokens)) if table[0][j] + table[1][j] >= 10]
        rest = [sum(row[j] for j in range(len(tokens)) if j not in keep) for row in table]
        table = [[row[j] for j in keep] + ([r] if sum(rest) else []) for row, r in zip(table, rest)]
        assert chi2_contingency(table).pvalue > 1e-3, (pos, table)
