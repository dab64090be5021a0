"""Elastic EP's pure parts: config checks, placement and move plans (against DeepSeek's EPLB
entry point), the controller's routing around a down rank, the manager's resume decisions, the
detokenizer's replay trimming, and the membership store."""

from __future__ import annotations

import pytest
import torch

from moeserve.config import ConfigError, compose
from moeserve.core import SamplingParams
from moeserve.dp_attention.controller import Router
from moeserve.elastic.membership import Membership, MembershipStore, connect_store
from moeserve.elastic.placement import CHECKPOINT, plan_moves, slots_per_rank, target_placement
from moeserve.elastic.retry import RANK_LOST_ERROR, RequestLedger
from moeserve.eplb.algorithm import rebalance_experts
from moeserve.ipc.messages import GenerateReq, RequestsLost, TextOutput, TokenOutput
from moeserve.procs.rendezvous import free_tcp_port
from moeserve.tokenizer.detokenizer import IncrementalDetokenizer, to_text_output

DP4 = ["parallel.tp_size=4", "parallel.dp_size=4"]


@pytest.mark.parametrize("overrides, key", [
    (["parallel.elastic_ep=true"], "parallel.elastic_ep"),
    (["parallel.elastic_relaunch=true"], "parallel.elastic_relaunch"),
    ([*DP4, "parallel.elastic_ep=true", "parallel.elastic_timeout_s=0"],
     "parallel.elastic_timeout_s"),
    ([*DP4, "parallel.elastic_ep=true", "parallel.a2a_backend=p2p"], "parallel.a2a_backend"),
    ([*DP4, "parallel.elastic_ep=true", "spec=nextn"], "spec.algorithm"),
    ([*DP4, "parallel.elastic_ep=true", "parallel.elastic_timeout_s=90"],
     "parallel.elastic_timeout_s"),
])
def test_bad_elastic_configs_name_the_key(overrides, key):
    with pytest.raises(ConfigError) as e:
        compose(overrides)
    assert e.value.key == key


def test_elastic_config_accepted():
    cfg = compose([*DP4, "parallel.elastic_ep=true", "parallel.elastic_relaunch=true"])
    assert cfg.parallel.elastic_ep and cfg.parallel.elastic_relaunch


def test_target_placement_covers_every_expert_on_survivors():
    load = torch.rand(3, 16) * 100
    original = torch.arange(16).expand(3, 16).clone()
    assert torch.equal(target_placement(load, (0, 1, 2, 3), 4, original, 4, 4), original)
    for members in [(0, 1, 3), (0, 3), (2,)]:
        slots = slots_per_rank(16, 4, len(members))
        p2l = target_placement(load, members, 4, original, 4, 4)
        assert p2l.shape == (3, slots * len(members))
        assert all(set(row.tolist()) == set(range(16)) for row in p2l)
        # DeepSeek's EPLB for the survivors, on the load (+1 so idle experts still count)
        oracle = rebalance_experts(load + 1, slots * len(members), 4, 1, len(members))
        assert torch.equal(p2l, oracle.phy2log)


def test_plan_moves_prefers_local_then_peers_then_checkpoint():
    holdings = [[0, 1, -1], [2, 3, 0], [4, 5, -1]]
    target = [0, 2, 6, 3, 1, 0, 4, 5, 2]  # 3 members x 3 slots
    moves = plan_moves(target, 3, holdings)
    assert [(m.dst, m.dst_slot, m.logical) for m in moves] == [
        (p // 3, p % 3, e) for p, e in enumerate(target)]
    by_slot = {(m.dst, m.dst_slot): m for m in moves}
    assert (by_slot[0, 0].src, by_slot[0, 0].src_slot) == (0, 0)  # a local copy
    assert (by_slot[0, 1].src, by_slot[0, 1].src_slot) == (1, 0)  # the only holder of 2
    assert by_slot[0, 2].src == CHECKPOINT  # nobody holds 6
    assert by_slot[1, 1].src == 0  # 1 is held by member 0 only
    assert (by_slot[1, 2].src, by_slot[1, 2].src_slot) == (1, 2)  # its own copy of 0
    assert all(holdings[m.src][m.src_slot] == m.logical for m in moves if m.src != CHECKPOINT)


def test_router_skips_down_ranks():
    r = Router(4, "round_robin")
    r.set_alive(2, False)
    assert [r.route([1]) for _ in range(6)] == [0, 1, 3, 0, 1, 3]
    with pytest.raises(ValueError, match="down"):
        r.route([1], dp_rank=2)
    q = Router(4, "shortest_queue")
    q.set_alive(0, False)
    assert q.route([1]) == 1


class _Count:
    def __init__(self):
        self.n = 0

    def inc(self, k=1):
        self.n += k


class _Metrics:
    def __init__(self):
        self.requests_retried, self.requests_failed = _Count(), _Count()


def test_ledger_resumes_greedy_and_fails_what_it_cannot_replay():
    sent, metrics = [], _Metrics()
    ledger = RequestLedger(sent.append, metrics)
    reqs = [GenerateReq(rid="g", input_ids=[5], sampling=SamplingParams(temperature=0)),
            GenerateReq(rid="s", input_ids=[5], sampling=SamplingParams(temperature=0.7, seed=3)),
            GenerateReq(rid="u", input_ids=[5], sampling=SamplingParams()),
            GenerateReq(rid="p", input_ids=[5], sampling=SamplingParams(temperature=0),
                        dp_rank=2)]
    for r in reqs:
        ledger.sent(r)
    ledger.on_output(TextOutput(rid="g", text_delta="", new_ids=[7, 8]))
    failed = ledger.on_lost(RequestsLost(rank=2, rids=["g", "s", "u", "p", "done"],
                                         cause="killed"), {"g", "s", "u", "p"})
    assert [(r.rid, r.resume_ids) for r in sent] == [("g", [7, 8]), ("u", [])]
    assert {rid for rid, _ in failed} == {"s", "p"}
    assert all(e.startswith(RANK_LOST_ERROR) and "rank 2 died" in e for _, e in failed)
    assert metrics.requests_retried.n == 2 and metrics.requests_failed.n == 2


def test_detokenizer_drops_replayed_positions():
    from transformers import AutoTokenizer

    from moeserve.models.embedded import embedded_model_path

    tok = AutoTokenizer.from_pretrained(embedded_model_path())
    ids = tok("Hello there, general Kenobi! You are a bold one.")["input_ids"]
    detok = IncrementalDetokenizer(tok)

    def out(start, end, finish=None):
        return TokenOutput(rid="r", new_ids=ids[start:end], completion_tokens=end,
                           finish_reason=finish)

    # the dead rank streamed [0, 6); the manager had seen [0, 4) and resumed from there; the
    # dead rank's [4, 6) arrives late, after the resumed run's [4, 8)
    parts = [out(0, 4), out(4, 8), out(4, 6), out(8, len(ids), "length")]
    texts = [to_text_output(detok, o) for o in parts]
    assert sum((t.new_ids for t in texts), []) == ids
    assert "".join(t.text_delta for t in texts) == tok.decode(ids, skip_special_tokens=True)


def test_membership_store_round_trip():
    addr = f"127.0.0.1:{free_tcp_port()}"
    master = connect_store(addr, master=True)
    store = MembershipStore(connect_store(addr))
    assert store.latest() is None
    MembershipStore(master).publish(Membership(0, (0, 1, 2, 3), "start", 1.0))
    MembershipStore(master).publish(Membership(1, (0, 1, 3), "rank 2 died", 2.0))
    m = store.wait_newer(0, 5)
    assert (m.generation, m.ranks, m.index(3)) == (1, (0, 1, 3), 2)
    store.beat(1)
    store.beat(1)
    assert store.beats(1) == 2 and store.beats(0) == 0
    store.report_failure(1, 0, "Connection reset")
    assert store.failure(1, 0) == "Connection reset" and store.failure(1, 1) is None
    with pytest.raises(TimeoutError):
        store.wait_newer(1, 0.1)
