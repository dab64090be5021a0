"""Draft trees (spec.topk > 1) are lossless: the tree's greedy walk against a brute-force one, its
rejection rule against the target distribution, and the Engine's outputs with a tree equal to the
same Engine's without speculation, with the tiny DeepSeek-V3's MTP layer and with an oracle tree
that puts the reference continuation at random children (blocks of every accepted length)."""

from __future__ import annotations

import random

import pytest
import torch
from parity import FP32_CPU, ID_VOCAB
from scipy.stats import chisquare

from moeserve import Engine
from moeserve.config import ConfigError, compose
from moeserve.core import SamplingParams
from moeserve.spec_mtp.tree import TreeShape, greedy_tree_accept, tree_rejection_accept
from spec_oracle import (assert_same_distribution, install_oracle_tree, install_ranked_tree,
                         oracle_workload)

GREEDY = {"temperature": 0, "ignore_eos": True}
TREE = ["spec.algorithm=nextn", "spec.max_batch_size=0"]


def test_tree_shape_heap_order():
    shape = TreeShape(3, 2)
    assert shape.nodes == 12 and list(shape.level(1)) == [1, 2, 3]
    assert list(shape.level(2)) == list(range(4, 13))
    anc = shape.ancestors()
    assert anc[0].tolist() == [-1, -1] and anc[2].tolist() == [2, -1]
    assert anc[7].tolist() == [2, 7]  # node 7 = second child of node 2 (3 * 2 + 1 = 7)


def _walk(shape: TreeShape, tokens: list[int], target: list[int]) -> list[int]:
    """Brute force: from the root, into the child holding the target's token, while one does."""
    node, path = 0, []
    for _ in range(shape.depth):
        kids = [c for c in shape.children(node) if tokens[c] == target[node]]
        if not kids:
            break
        node = kids[0]
        path.append(node)
    return path


PRUNED = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (1, 0, 0)]


@pytest.mark.parametrize("shape", [TreeShape(2, 3), TreeShape(3, 2), TreeShape(4, 1),
                                   TreeShape(3, 3, PRUNED)], ids=["k2n3", "k3n2", "k4n1", "pruned"])
def test_greedy_tree_accept_equals_brute_force(shape):
    rng = random.Random(shape.nodes)
    b, w = 64, shape.nodes + 1
    tokens = [[rng.randrange(5) for _ in range(w)] for _ in range(b)]
    for row in tokens:  # siblings are distinct, as the draft's top k are
        for parent in range(w):
            kids = shape.children(parent)
            for j, c in enumerate(kids):
                row[c] = (row[kids[0]] + j) % 7 if j else row[c] % 7
    target = [[rng.randrange(7) for _ in range(w)] for _ in range(b)]
    path, accepted = greedy_tree_accept(shape, torch.tensor(tokens), torch.tensor(target))
    lengths = set()
    for i in range(b):
        want = _walk(shape, tokens[i], target[i])
        lengths.add(len(want))
        assert int(accepted[i]) == len(want) and path[i, : len(want)].tolist() == want
    assert len(lengths) > 1


def test_pruned_tree_shape():
    """Breadth-first numbering of any rank-path set; `best` takes the most counted paths (ties
    and unmeasured paths by the positional prior), always a tree; bad path sets are refused."""
    shape = TreeShape(3, 3, PRUNED)
    assert shape.nodes == 9 and shape.depth == 3 and list(shape.level(2)) == [4, 5, 6]
    assert shape.children(0) == [1, 2, 3] and shape.children(1) == [4, 5]
    assert shape.children(4) == [7, 8] and shape.children(6) == [9] and shape.children(3) == []
    assert shape.ancestors()[8].tolist() == [1, 4, 8]
    counts = {(0,): 100, (1,): 40, (0, 0): 50, (0, 0, 0): 30, (2,): 20, (0, 1): 20}
    best = TreeShape.best(3, 3, 5, counts)
    # (2,) and (0, 1) tie at 20: the prior prefers (0, 1) (0.6 * 0.12 > 0.05)
    assert best.paths == [(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]
    assert TreeShape.best(3, 3, 6, counts).paths == [(0,), (1,), (2,), (0, 0), (0, 1), (0, 0, 0)]
    prior = TreeShape.best(2, 3, 3)  # no counts: the chain first (0.6, 0.36, 0.216 > 0.12)
    assert prior.paths == [(0,), (0, 0), (0, 0, 0)]
    for shape in (best, prior, TreeShape.best(4, 3, 20)):
        assert all(p[:-1] in shape.paths or len(p) == 1 for p in shape.paths)
    # the most counted M nodes are the best M-node tree: brute force over every 5-node tree of
    # ranks < 2, depth <= 3, with counts made as the eval makes them (every prefix of a path)
    import itertools
    from collections import Counter

    rng, counted = random.Random(1), Counter()
    for _ in range(300):
        path = tuple(0 if rng.random() < 0.6 else 1 for _ in range(rng.randrange(4)))
        for d in range(1, len(path) + 1):
            counted[path[:d]] += 1
    candidates = TreeShape(2, 3).paths
    trees = [set(c) for c in itertools.combinations(candidates, 5)
             if all(len(p) == 1 or p[:-1] in c for p in c)]
    best_total = max(sum(counted[p] for p in t) for t in trees)
    assert sum(counted[p] for p in TreeShape.best(2, 3, 5, counted).paths) == best_total
    with pytest.raises(ValueError, match="parent"):
        TreeShape(2, 3, [(0,), (1, 1)])
    with pytest.raises(ValueError, match="rank"):
        TreeShape(2, 3, [(0,), (2,)])


def test_tree_rejection_rule_draws_the_target_distribution():
    """Over 20000 draws the first emitted token follows the target's processed distribution
    (chi-squared, p > 1e-3), whatever the children are: here the third most likely token, then
    the second, then one outside top-p. The wrong rule that accepts a later child with its p(c)
    without renormalising the residual fails this (p ~ 0)."""
    shape = TreeShape(3, 1)
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]] * 4)
    params = SamplingParams(temperature=0.8, top_p=0.95)
    children = [0, 2, 1, 5]  # root entry unused; node 1..3: tokens 2, 1, 5
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(6)
    n = 20000
    for _ in range(n):
        emitted, _ = tree_rejection_accept(shape, logits, children, params, gen)
        counts[emitted[0]] += 1
    from moeserve.runtime.sampler import target_probs
    p = target_probs(logits[0], params)
    keep = p > 0
    assert counts[~keep].sum() == 0
    assert chisquare(counts[keep].numpy(), (p[keep] * n).numpy()).pvalue > 1e-3


def test_tree_config_errors_name_the_key():
    with pytest.raises(ConfigError, match=r"spec\.topk"):
        compose(["spec=nextn", "spec.topk=9"])
    with pytest.raises(ConfigError, match=r"spec\.topk"):
        compose(["spec=nextn", "spec.topk=4", "spec.num_steps=4"])  # 340 nodes
    with pytest.raises(ConfigError, match=r"spec\.topk.*DP attention"):
        compose(["spec=nextn", "spec.topk=2", "parallel.tp_size=2", "parallel.dp_size=2"])
    cfg = compose(["spec=nextn", "spec.topk=2", "spec.num_steps=3"])
    assert cfg.spec.draft_nodes == 14 and cfg.spec.verify_width == 15
    cfg = compose(["spec=nextn", "spec.topk=4", "spec.num_steps=4", "spec.num_draft_tokens=9"])
    assert cfg.spec.draft_nodes == 8 and cfg.spec.verify_width == 9  # pruned: fits
    with pytest.raises(ConfigError, match=r"spec\.num_draft_tokens.*topk > 1"):
        compose(["spec=nextn", "spec.num_draft_tokens=4"])
    with pytest.raises(ConfigError, match=r"spec\.num_draft_tokens.*\[3, 7\]"):
        compose(["spec=nextn", "spec.topk=2", "spec.num_steps=2", "spec.num_draft_tokens=8"])


@pytest.fixture(scope="module")
def dsv3(tiny_model):
    path = tiny_model("deepseek_v3", vocab_size=ID_VOCAB)
    rng = random.Random(0)
    with Engine(path, FP32_CPU) as eng:
        vocab = eng.runner.hf_config.vocab_size
        system = [rng.randrange(3, vocab) for _ in range(20)]
        prompts = [(system if i % 2 else system[:5]) +
                   [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 30))]
                   for i in range(10)]
        reference, params, plain = oracle_workload(eng, prompts, rng)
    return path, prompts, params, reference, plain


@pytest.mark.parametrize("overrides", [
    ["spec.topk=2", "spec.num_steps=3", "scheduler.overlap=false"],
    ["spec.topk=3", "spec.num_steps=2", "scheduler.overlap=true",
     "scheduler.chunked_prefill_size=8"],
    ["spec.topk=3", "spec.num_steps=3", "spec.num_draft_tokens=7", "scheduler.overlap=true"],
], ids=["k2-n3-normal", "k3-n2-overlap-chunked", "pruned-k3-n3-m6-overlap"])
def test_mtp_layer_tree_equals_plain(dsv3, overrides):
    path, prompts, params, _, plain = dsv3
    with Engine(path, FP32_CPU + TREE + overrides) as eng:
        for _ in range(2):  # the second run is served mostly from the prefix cache
            outs = eng.generate(input_ids=prompts, sampling_params=params)
            assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in plain]
        assert eng.scheduler.is_memory_clean()


def test_nextn_head_tree_equals_plain(tiny_model):
    """A NextN head (random) drafting trees on Llama: its chain passes over tree levels run the
    head's own kernels (rope on each level's positions), and the outputs are plain decoding's."""
    path = tiny_model("llama", vocab_size=ID_VOCAB)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 200) for _ in range(rng.randrange(2, 25))] for _ in range(6)]
    params = {**GREEDY, "max_new_tokens": 14}
    with Engine(path, FP32_CPU) as eng:
        plain = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=params)]
    spec = TREE + ["spec.draft_path=dummy", "spec.topk=2", "spec.num_steps=3"]
    with Engine(path, FP32_CPU + spec) as eng:
        outs = eng.generate(input_ids=prompts, sampling_params=params)
        assert [o["output_ids"] for o in outs] == plain
        assert all(o["meta"]["spec_verify_steps"] >= 1 for o in outs)
        alone = eng.generate(input_ids=prompts[:1], sampling_params=params)  # batch 1
        assert alone[0]["output_ids"] == plain[0]
        assert eng.scheduler.is_memory_clean()


@pytest.mark.parametrize("k,n,corrupt,width", [(2, 3, 0.0, 0), (2, 3, 0.3, 0), (3, 2, 0.5, 0),
                                                (2, 2, 1.0, 0), (3, 3, 0.0, 8), (3, 3, 0.3, 6)])
def test_oracle_tree_blocks_equal_plain(dsv3, k, n, corrupt, width):
    """Accepted paths through any child give the plain tokens and logprobs; the KV pool returns
    to its size (the rejected nodes' slots are freed, the path's kept). width > 0: a pruned
    tree of width - 1 nodes (some with fewer children than others, leaves above depth n)."""
    path, prompts, params, reference, plain = dsv3
    overrides = FP32_CPU + TREE + [f"spec.topk={k}", f"spec.num_steps={n}",
                                   f"spec.num_draft_tokens={width}"]
    with Engine(path, overrides) as eng:
        install_oracle_tree(eng, reference, corrupt, seed=3)
        outs = eng.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
        assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in plain]
        for o, want in zip(outs, plain):
            assert o["meta"]["output_logprobs"] == pytest.approx(
                want["meta"]["output_logprobs"], abs=1e-4)
        lengths = [o["meta"]["spec_accept_length"] for o in outs
                   if o["meta"].get("spec_verify_steps", 0) >= 2]
        mean = sum(lengths) / len(lengths)
        if corrupt == 0.0 and not width:
            assert mean > n  # nearly every path is accepted to the bottom
        elif corrupt == 0.0:  # the reference sits at a random child: pruned ones miss it
            assert 1.5 < mean < n + 1
        elif corrupt == 1.0:
            assert mean == 1.0
        else:
            assert 1.0 < mean < n + 1
        assert eng.scheduler.is_memory_clean()
        eng.scheduler.cache.flush()
        assert eng.runner.memory.allocator.available_size() == eng.runner.memory.allocator.size


def test_tree_sampling_distribution_matches_plain(tiny_model):
    """Through the Engine: the first three sampled tokens with a draft tree (k=2, depth 2) are
    distributed as without speculation (chi-squared homogeneity per position, p > 1e-3), at
    temperature 0.7 and top_p 0.9 on a 24-token vocabulary. The children are the plain run's two
    most frequent tokens at each position, so paths through the first and the second child both
    occur. (In context the two often do not both have probability, so this checks the plumbing;
    the rule itself is checked, mutation-sensitive, by the test above.)"""
    path = tiny_model("deepseek_v3", vocab_size=24, initializer_range=0.3)  # peaked logits
    prompt = [[5, 9, 3, 17, 11]]
    sp = {"temperature": 0.7, "top_p": 0.9, "max_new_tokens": 3, "ignore_eos": True}
    samples, ranked = {}, []
    for name, extra in (("plain", []), ("tree", TREE + ["spec.topk=2", "spec.num_steps=2"])):
        with Engine(path, FP32_CPU + extra + ["cache.max_running_requests=256"]) as eng:
            if name == "tree":
                install_ranked_tree(eng, ranked)
                decoder = eng.scheduler.worker.spec
                seen = []
                verify = decoder._verify

                def spy(fi, geo, tokens):
                    out = verify(fi, geo, tokens)
                    seen.extend(p[0] for p in out[0].spec_paths if p)
                    return out
                decoder._verify = spy
            params = [{**sp, "seed": 1000 * (name == "tree") + i} for i in range(1500)]
            outs = eng.generate(input_ids=prompt * len(params), sampling_params=params)
            samples[name] = [o["output_ids"] for o in outs]
            if name == "plain":
                for col in zip(*samples[name]):
                    ranked.append(sorted(set(col), key=lambda t: -col.count(t))[:2] + [0, 1])
            else:  # accepted first nodes: the first child and the second, each often
                assert seen.count(1) > 100 and seen.count(2) > 100, (seen.count(1), seen.count(2))
    assert_same_distribution(samples)
