"""Data-parallel attention through the DP controller: routing policies (unit), the multi-rank
Engine against the single-process Engine on tiny MoE models and the embedded SmolLM2 (token-identical
greedy outputs, skewed loads), and the HTTP server with tp2/dp2 (concurrent OpenAI chat, /server_info,
a killed rank takes the server down).

Rank processes run with OMP_NUM_THREADS=1 (the CPU has 2 cores). MoE models use expert parallelism
(ep_size = tp_size) with the a2a, allgather and p2p dispatchers.
"""

from __future__ import annotations

import os
import re
import time

import pytest
from dp_workloads import (CHAT_LENS, DP2, DP4, GREEDY, ONE, QUESTIONS,  # noqa: F401
                          constrained, ep_overrides, ids_of, skew_long_short, staggered, workload)
from live_server import assert_chats_equal, concurrent_chats, role_processes
from parity import FP32_CPU

import httpx

from moeserve import Engine
from moeserve.dp_attention.controller import PrefixIndex, Router, block_hashes
from moeserve.ipc.messages import LoadReport





@pytest.fixture(scope="module", autouse=True)
def one_thread_per_rank():
    """Children inherit the environment: one intra-op thread per rank process."""
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    yield
    if old is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = old


# ---- Router (pure) -------------------------------------------------------------------------------
def test_round_robin_order_and_pin():
    r = Router(3, "round_robin")
    assert [r.route([1, 2]) for _ in range(5)] == [0, 1, 2, 0, 1]
    assert r.route([1, 2], dp_rank=0) == 0  # a pin does not advance the turn
    assert r.route([1, 2]) == 2


def test_shortest_queue_uses_reports_and_routed_since():
    r = Router(3, "shortest_queue")
    r.on_report(0, running=3, waiting=1)
    r.on_report(1, running=0, waiting=0)
    r.on_report(2, running=2, waiting=0)
    picks = [r.route([7]) for _ in range(6)]
    assert picks == [1, 1, 1, 2, 1, 2]  # a burst fills the gaps instead of piling on rank 1
    assert [r.load(i) for i in range(3)] == [4, 4, 4]
    r.on_report(1, running=9, waiting=0)  # a report replaces the estimate
    assert r.route([7]) == 0


def test_prefix_aware_affinity_and_margin():
    r = Router(2, "prefix_aware", margin=2, block_tokens=4)
    shared = list(range(100, 112))  # three blocks
    assert r.route(shared + [1]) == 0  # nothing cached anywhere: least loaded
    assert r.route([5, 6, 7, 8, 9]) == 1  # no match: least loaded
    # rank 0 holds the prefix: preferred while its load is within the margin of rank 1's
    assert [r.route(shared + [i]) for i in range(2, 5)] == [0, 0, 0]
    assert r.load(0) - r.load(1) == 3
    assert r.route(shared + [9]) == 1  # over the margin: least loaded
    # now both ranks index the prefix: equal matches go to the lighter rank
    assert (r.load(0), r.load(1)) == (4, 2)
    assert r.route(shared[:8] + [0] * 8) == 1


def test_prefix_aware_longest_match_wins():
    r = Router(2, "prefix_aware", margin=8, block_tokens=4)
    a, b = list(range(100, 108)), list(range(200, 216))
    assert r.route(b, dp_rank=1) == 1
    assert r.route(a, dp_rank=0) == 0
    assert r.route(a[:4] + b) == 0  # only the leading run counts: a's first block
    assert r.route(b + [1, 2]) == 1
    assert r.route([9] * 20) == 0  # no match: least loaded (2 each: the lowest rank)


def test_pinned_and_bad_dp_rank():
    for policy in ("round_robin", "shortest_queue", "prefix_aware"):
        r = Router(2, policy)
        assert r.route([1, 2, 3], dp_rank=1) == 1
        assert r.load(1) == 1
        for bad in (-1, 2, 17):
            with pytest.raises(ValueError, match=f"dp_rank {bad} is out of range"):
                r.route([1], dp_rank=bad)
    with pytest.raises(ValueError, match="unknown dp policy"):
        Router(2, "random")


def test_prefix_index_lru_and_block_hashes():
    assert block_hashes(list(range(10)), 4)[:2] == block_hashes(list(range(8)), 4)
    assert block_hashes([1, 2, 3], 4) == []
    assert block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)[1] != block_hashes([0, 0, 0, 0, 5, 6, 7, 8], 4)[1]
    index = PrefixIndex(capacity=4)
    old, new = block_hashes(list(range(8)), 4), block_hashes(list(range(50, 66)), 4)
    index.insert(old)
    assert index.match(old) == 2
    index.insert(new)  # 6 blocks > capacity: the least recently used go first
    assert len(index) == 4 and index.match(old) == 0 and index.match(new) == 4


# ---- the controller process loop, over real sockets in this process -----------------------------
def test_controller_wake_abort_control_and_bad_pin():
    import zmq

    from moeserve.config import compose
    from moeserve.core import SamplingParams
    from moeserve.dp_attention.controller import DataParallelController
    from moeserve.ipc.messages import (AbortReq, ControlReq, DetokenizerInput, GenerateReq,
                                       SchedulerInput, Wake)
    from moeserve.ipc.queues import Endpoints, PullQueue, PushQueue
    from moeserve.procs.ipc_files import remove_ipc_files

    cfg = compose(DP2 + ["parallel.dp_policy=round_robin"])
    ep = Endpoints.fresh(2)
    ctl = DataParallelController(cfg, ep)
    ctx = zmq.Context()
    ranks = [PullQueue(ctx, a, SchedulerInput) for a in ep.rank_in]
    detok = PullQueue(ctx, ep.detokenizer_in, DetokenizerInput)
    client = PushQueue(ctx, ep.scheduler_in)
    reports = PushQueue(ctx, ep.controller_in)

    def drain(q, wait_ms=2000):
        first = q.get(wait_ms)
        return ([first] if first is not None else []) + q.get_nowait_all()

    def step_until(done, queues, timeout_s=20.0):
        """Step the controller until done() holds over what `queues` received (a loaded CI host
        may take longer than any fixed sleep to deliver the client's messages)."""
        nonlocal got
        got = [[] for _ in queues]
        deadline = time.monotonic() + timeout_s
        while not done() and time.monotonic() < deadline:
            ctl.step(50)
            for g, q in zip(got, queues):
                g.extend(q.get_nowait_all())
        return got

    got: list = []

    try:
        sp = SamplingParams(max_new_tokens=1)
        client.put(GenerateReq(rid="a", input_ids=[1, 2], sampling=sp))
        ctl.step(2000)
        assert [type(m) for m in drain(ranks[0])] == [GenerateReq]
        assert drain(ranks[1]) == [Wake()]  # the other rank leaves its idle wait
        client.put(AbortReq(rid="a"))
        client.put(AbortReq(rid="never-routed"))
        client.put(ControlReq(cid=3, op="server_info"))
        got = step_until(lambda: len(got[0]) >= 3 and len(got[1]) >= 2, ranks)
        assert got[0] == [AbortReq(rid="a"), AbortReq(rid="never-routed"),
                          ControlReq(cid=3, op="server_info")]
        assert got[1] == [AbortReq(rid="never-routed"), ControlReq(cid=3, op="server_info")]
        reports.put(LoadReport(rank=0, running=5, waiting=0, used_tokens=0, max_total_tokens=1))
        client.put(GenerateReq(rid="b", input_ids=[3], sampling=sp, dp_rank=7))
        got = step_until(lambda: ctl.router.load(0) == 5 and got[0], [detok])
        assert ctl.router.load(0) == 5
        (batch,) = got[0]
        assert batch.outputs[0].rid == "b" and batch.outputs[0].finish_reason == "abort"
        assert "dp_rank 7 is out of range [0, 2)" in batch.outputs[0].error
        assert ranks[0].get(100) is None and ranks[1].get(100) is None  # no Wake: nothing routed
    finally:
        ctl.ctx.destroy(linger=0)
        ctx.destroy(linger=0)
        remove_ipc_files(ep)


# ---- multi-rank Engine vs single-process Engine -------------------------------------------------


# (model, policy, a2a backend, loop): every policy and every CPU backend on each model
DP_CASES = [("qwen3_moe", "round_robin", "a2a", "overlap"),
            ("qwen3_moe", "shortest_queue", "allgather", "overlap"),
            ("qwen3_moe", "prefix_aware", "p2p", "normal"),
            ("deepseek_v3", "round_robin", "p2p", "overlap"),
            ("deepseek_v3", "shortest_queue", "a2a", "normal"),
            ("deepseek_v3", "prefix_aware", "allgather", "overlap")]


@pytest.fixture(scope="module", params=DP_CASES, ids=["-".join(c) for c in DP_CASES])
def dp_engine(request, reference):
    arch, policy, backend, loop = request.param
    ref = reference(arch)
    overrides = FP32_CPU + DP2 + ep_overrides(backend) + [
        f"parallel.dp_policy={policy}", "scheduler.chunked_prefill_size=16",
        f"scheduler.overlap={str(loop == 'overlap').lower()}"]
    eng = Engine(ref["path"], overrides)
    yield eng, ref
    eng.shutdown()


@pytest.mark.timeout(150)
def test_dp2_workload_matches_single_process(dp_engine):
    eng, ref = dp_engine
    prompts, params = workload()
    assert ids_of(eng.generate(input_ids=prompts, sampling_params=params)) == ref["workload"]
    again = eng.generate(input_ids=prompts, sampling_params=params)  # cache hits on some rank
    assert ids_of(again) == ref["workload"]
    ranks = eng.server_info()
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(r["prompt_tokens"] > 0 for r in ranks)  # both ranks served requests
    assert all(r["running"] == r["waiting"] == 0 for r in ranks)
    if eng.config.parallel.dp_policy == "prefix_aware":  # the second round found its prefixes
        cached = sum(o["meta"]["cached_tokens"] for o in again)
        assert cached >= sum(map(len, prompts)) // 2


@pytest.mark.timeout(60)
def test_dp2_single_request_other_rank_idle(dp_engine):
    eng, ref = dp_engine
    before = [r["prompt_tokens"] for r in eng.server_info()]
    assert ids_of(eng.generate(input_ids=ONE[0], sampling_params=ONE[1], dp_ranks=[1])) == ref["one"]
    after = [r["prompt_tokens"] for r in eng.server_info()]
    assert after[0] == before[0] and after[1] == before[1] + len(ONE[0][0])
    assert ids_of(eng.generate(input_ids=ONE[0], sampling_params=ONE[1])) == ref["one"]


@pytest.mark.timeout(60)
def test_dp2_long_chunked_prefill_beside_decodes(dp_engine):
    eng, ref = dp_engine
    prompts, params, pins = skew_long_short()
    outs = eng.generate(input_ids=prompts, sampling_params=params, dp_ranks=pins)
    assert ids_of(outs) == ref["long_short"]


@pytest.mark.timeout(60)
def test_dp2_requests_finish_at_different_steps(dp_engine):
    eng, ref = dp_engine
    prompts, params = staggered()
    outs = eng.generate(input_ids=prompts, sampling_params=params)
    assert ids_of(outs) == ref["staggered"]
    assert [o["meta"]["completion_tokens"] for o in outs] == [p["max_new_tokens"] for p in params]


@pytest.mark.timeout(90)
def test_dp2_structured_outputs_match_single_process(dp_engine):
    """Grammars compile and mask on whichever rank serves the request, idle steps on the other
    included; a stop string inside a constrained reply cuts it as in one process."""
    eng, ref = dp_engine
    prompts, params = constrained()
    outs = eng.generate(input_ids=prompts, sampling_params=params)
    assert ids_of(outs) == ref["constrained"]
    assert outs[0]["meta"]["finish_reason"] == "stop"  # the regex completed
    assert re.fullmatch("(yes|no), [a-z]{2,8}", outs[0]["text"]), outs[0]["text"]
    assert outs[1]["text"] == outs[0]["text"].split(", ")[0]  # stopped at ", "


@pytest.mark.timeout(60)
def test_dp2_bad_pin_fails_that_request(dp_engine):
    eng, _ = dp_engine
    with pytest.raises(ValueError, match="dp_rank 2 is out of range"):
        eng.generate(input_ids=[[5, 6, 7]], sampling_params={"max_new_tokens": 2}, dp_ranks=[2])


# ---- dense SmolLM2 through the same controller --------------------------------------------------
@pytest.mark.timeout(180)
def test_smollm2_dp2_chat_matches_single_process():
    questions = ["What is the capital of France?", "Name three colours.",
                 "What is the capital of France?"]
    greedy = {"temperature": 0, "max_new_tokens": 16}
    params = [greedy, greedy, {**greedy, "stop": ["Paris"]}]  # the stop string is cut off
    with Engine(overrides=FP32_CPU) as eng:
        chats = [eng.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
        expected = eng.generate(input_ids=chats, sampling_params=params)
    with Engine(overrides=FP32_CPU + DP2 + ["parallel.dp_policy=shortest_queue"]) as eng:
        with pytest.raises(AttributeError, match="single-rank"):
            _ = eng.scheduler
        outs = eng.generate(input_ids=chats, sampling_params=params)
        assert [r["prompt_tokens"] > 0 for r in eng.server_info()] == [True, True]
    assert ids_of(outs) == ids_of(expected)
    assert [o["text"] for o in outs] == [o["text"] for o in expected]
    assert "Paris" in outs[0]["text"] and outs[2]["text"] == outs[0]["text"].split("Paris")[0]
    assert outs[2]["meta"]["finish_reason"] == "stop"


# ---- HTTP server with tp2/dp2 -------------------------------------------------------------------
@pytest.fixture(scope="module")
def dp_server(reference):
    from live_server import LiveServer

    ref = reference("deepseek_v3")  # before the server: its ranks do not idle through it
    live = LiveServer([f"model.path={ref['path']}", *FP32_CPU, *DP2, *ep_overrides("a2a"),
                       "parallel.dp_policy=shortest_queue"]).wait_healthy()
    yield live, ref
    live.stop(keep_log=live.proc.returncode not in (None, 0, 1))


@pytest.mark.timeout(240)
def test_http_dp2_concurrent_chat_matches_engine(dp_server):
    """8 concurrent greedy chats through the official openai client: the single-process
    Engine's texts and token counts (the session's reference)."""
    live, ref = dp_server
    assert_chats_equal(concurrent_chats(live.url, QUESTIONS, CHAT_LENS), CHAT_LENS, ref["chats"])


@pytest.mark.timeout(60)
def test_http_server_info_lists_two_ranks(dp_server):
    live, _ = dp_server
    info = httpx.get(live.url + "/server_info", timeout=30).json()
    assert [r["rank"] for r in info["ranks"]] == [0, 1]
    assert {"scheduler:0", "scheduler:1", "controller:0", "detokenizer:0"} <= info["ready"].keys()
    assert info["ready"]["scheduler:1"]["dp_rank"] == 1


@pytest.mark.timeout(90)
def test_http_killed_rank_brings_server_down(dp_server):
    """Runs last in this module: it ends the shared server."""
    psutil = pytest.importorskip("psutil")
    live, _ = dp_server
    ready = httpx.get(live.url + "/server_info", timeout=30).json()["ready"]
    roles = {ready["detokenizer:0"]["pid"], ready["controller:0"]["pid"]}
    kids = role_processes(live.proc.pid)
    ranks = [p for p in kids if p.pid not in roles]
    assert len(kids) == 4 and len(ranks) == 2
    victim = ranks[-1]
    victim.kill()
    assert live.proc.wait(60) == 1
    _, alive = psutil.wait_procs(kids, timeout=15)
    assert alive == []
    log = live.log_tail(20000)
    assert re.search(rf"child process 'scheduler-[01]' \(pid {victim.pid}\) died with exit code -9",
                     log), log[-3000:]


# ---- dp4 x ep4 (4 processes) and EPLB placements across ranks -----------------------------------


@pytest.mark.timeout(300)
@pytest.mark.parametrize("arch,backend,policy", [("deepseek_v3", "a2a", "shortest_queue"),
                                                 ("qwen3_moe", "p2p", "round_robin")])
def test_dp4_ep4_matches_single_process(reference, arch, backend, policy):
    ref = reference(arch)
    overrides = FP32_CPU + DP4 + ep_overrides(backend) + [f"parallel.dp_policy={policy}"]
    with Engine(ref["path"], overrides) as eng:
        prompts, params = workload()
        assert ids_of(eng.generate(input_ids=prompts, sampling_params=params)) == ref["workload"]
        assert ids_of(eng.generate(input_ids=ONE[0], sampling_params=ONE[1])) == ref["one"]
        ranks = eng.server_info()
        assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
        assert sum(r["prompt_tokens"] > 0 for r in ranks) >= 3  # work spread over ranks


@pytest.mark.timeout(200)
def test_dp2_ep2_redundant_experts_and_eplb_placement(reference, tmp_path):
    """Physical experts = logical + 2 replicas over 2 ranks, trivial and EPLB placements: the
    same greedy outputs as one process without any placement."""
    import torch

    from moeserve.eplb.location import ExpertLocation

    ref = reference("deepseek_v3")
    load = torch.rand(4, 16, generator=torch.Generator().manual_seed(0)) ** 3 * 1000
    placement = str(tmp_path / "placement.json")
    ExpertLocation.from_algorithm(load, ep_size=2, num_redundant=2).save(placement)
    prompts, params = workload()
    for extra in (["eplb.num_redundant_experts=2"],
                  ["eplb.num_redundant_experts=2", f"eplb.init_placement={placement}"]):
        with Engine(ref["path"], FP32_CPU + DP2 + ep_overrides("a2a") + extra) as eng:
            assert ids_of(eng.generate(input_ids=prompts, sampling_params=params)) == \
                ref["workload"]
