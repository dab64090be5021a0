"""The routing hooks (layers/router_skew.py). MOESERVE_TEST_ZIPF_ROUTER: the bias encodes a Zipf
popularity; with it on, the recorded expert loads of a tiny model follow that order; off (the
default), no bias exists and greedy outputs are those of "0". MOESERVE_TEST_RANDOM_ROUTER: uniform
random experts."""

from __future__ import annotations

import random

import pytest
import torch
from parity import FP32_CPU

from moeserve import Engine
from moeserve.eplb.recorder import merge_rank_dumps
from moeserve.layers.router_skew import (routing_hook_name, routing_skew, skewed,
                                         zipf_logit_bias, zipf_popularity)

GREEDY = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 6}


def _prompts(n: int = 12) -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(100, 3000) for _ in range(rng.randrange(8, 20))] for _ in range(n)]


def test_bias_encodes_zipf_popularity_per_layer():
    p = zipf_popularity(16, 1.2, layer_id=3)
    want = 1.0 / torch.arange(1, 17, dtype=torch.float64) ** 1.2
    torch.testing.assert_close(p.sort(descending=True).values, want / want.sum())
    assert torch.equal(zipf_logit_bias(16, 1.2, 3), zipf_logit_bias(16, 1.2, 3))  # every rank
    assert not torch.equal(zipf_logit_bias(16, 1.2, 3), zipf_logit_bias(16, 1.2, 4))
    assert float(zipf_logit_bias(16, 1.2, 3).max()) == 0.0  # the hottest expert: ln(1)


def test_hook_is_off_by_default(monkeypatch):
    monkeypatch.delenv("MOESERVE_TEST_ZIPF_ROUTER", raising=False)
    assert routing_skew(16, 1, torch.device("cpu")) is None
    monkeypatch.setenv("MOESERVE_TEST_ZIPF_ROUTER", "0")
    assert routing_skew(16, 1, torch.device("cpu")) is None
    monkeypatch.setenv("MOESERVE_TEST_ZIPF_ROUTER", "-1")
    with pytest.raises(ValueError, match="MOESERVE_TEST_ZIPF_ROUTER"):
        routing_skew(16, 1, torch.device("cpu"))


def _run(path: str) -> tuple[list[list[int]], torch.Tensor, list]:
    """Greedy outputs, the recorded logical load [L, E] and the MoE blocks' biases."""
    with Engine(path, FP32_CPU + ["eplb.record_mode=stat"]) as eng:
        outs = [o["output_ids"] for o in eng.generate(input_ids=_prompts(),
                                                      sampling_params=GREEDY)]
        replies = eng.control("expert_record_dump")
        biases = [getattr(getattr(layer, layer.mlp_name), "logit_skew", None)
                  for layer in eng.runner.model.model.layers]
    assert all(r["ok"] for r in replies)
    return outs, merge_rank_dumps(replies, {}).logical_load(), biases


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3_moe"])
def test_recorded_load_follows_the_skew(tiny_model, monkeypatch, arch):
    path = tiny_model(arch)
    monkeypatch.delenv("MOESERVE_TEST_ZIPF_ROUTER", raising=False)
    plain_outs, plain_load, plain_biases = _run(path)
    assert all(b is None for b in plain_biases)
    monkeypatch.setenv("MOESERVE_TEST_ZIPF_ROUTER", "0")
    assert _run(path)[0] == plain_outs  # "0" is off as well
    monkeypatch.setenv("MOESERVE_TEST_ZIPF_ROUTER", "1.2")
    skew_outs, load, biases = _run(path)
    assert skew_outs != plain_outs  # the hook is live
    moe_layers = [i for i, row in enumerate(load) if row.sum() > 0]
    assert moe_layers and all(biases[i] is not None for i in moe_layers)
    num_experts = load.shape[1]
    for i in moe_layers:
        order = zipf_popularity(num_experts, 1.2, i).argsort(descending=True)  # hottest first
        by_rank = load[i][order].double()  # [E] loads in popularity order
        assert int(load[i].argmax()) == int(order[0]), (i, load[i].tolist(), order.tolist())
        half = num_experts // 2
        assert by_rank[:half].sum() > 2 * by_rank[half:].sum(), by_rank.tolist()
        hot_share = float(by_rank[0] / by_rank.sum())
        plain_share = float(plain_load[i][order[0]] / plain_load[i].sum())
        assert hot_share > plain_share, (hot_share, plain_share)


def test_random_router_draws_uniform_experts(monkeypatch):
    """MOESERVE_TEST_RANDOM_ROUTER: logits collapsed onto one expert (as dummy weights' deep
    layers route) come out as fresh uniform draws, so the top-k spreads over every expert."""
    monkeypatch.setenv("MOESERVE_TEST_RANDOM_ROUTER", "1")
    monkeypatch.setenv("MOESERVE_TEST_ZIPF_ROUTER", "1.2")  # the random hook takes precedence
    hook = routing_skew(16, 1, torch.device("cpu"))
    collapsed = torch.zeros(4096, 16, dtype=torch.bfloat16)
    collapsed[:, 3] = 10.0
    drawn = skewed(collapsed, hook)
    assert drawn.dtype == torch.bfloat16 and drawn.shape == collapsed.shape
    assert not torch.equal(drawn, skewed(collapsed, hook))  # fresh each call
    assert all(len(set(row.tolist())) == 16 for row in drawn[:64])  # no ties
    load = torch.bincount(drawn.float().topk(4, dim=1).indices.flatten(), minlength=16)
    assert load.min() > 0.8 * 4096 * 4 / 16 and load.max() < 1.2 * 4096 * 4 / 16
    assert skewed(collapsed, None) is collapsed
    assert routing_hook_name().startswith("uniform random")  # what bench headers print
    monkeypatch.setenv("MOESERVE_TEST_RANDOM_ROUTER", "0")
    assert torch.is_tensor(routing_skew(16, 1, torch.device("cpu")))  # back to the Zipf bias
    assert routing_hook_name().startswith("zipf 1.2")
    monkeypatch.setenv("MOESERVE_TEST_ZIPF_ROUTER", "0")
    assert routing_hook_name() == "router"
