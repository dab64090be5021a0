"""Record under load → dump over HTTP → report → rebalance → restart with the placement: on
dp2 x ep2, the measured per-rank load of the same workload is better balanced, outputs unchanged.

The restart is an offline Engine (the same ranks and placement loading as the server's, recorded
through the same control ops that the HTTP routes call): the HTTP side is the first server's, and
a second server cost ~10 CPU-s more than an Engine."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from live_server import LiveServer
from parity import FP32_CPU

from moeserve import Engine
from moeserve.eplb.algorithm import balancedness
from moeserve.eplb.cli import main as eplb_main
from moeserve.eplb.recorder import load_dump, merge_rank_dumps

import httpx

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
DP2 = ["parallel.tp_size=2", "parallel.dp_size=2", "parallel.dp_policy=round_robin"]
GREEDY = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 8}


async def _load(url: str, prompts: list[list[int]]) -> list[list[int]]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        rs = await asyncio.gather(*[c.post("/generate", json={"input_ids": p,
                                                              "sampling_params": GREEDY})
                                    for p in prompts])
    return [r.json()["output_ids"] for r in rs]


def _record(args: list[str], prompts: list[list[int]], dump_path: str) -> list[list[int]]:
    live = LiveServer(args).wait_healthy()
    try:
        assert httpx.post(live.url + "/start_expert_distribution_record").status_code == 200
        outs = asyncio.run(_load(live.url, prompts))
        r = httpx.post(live.url + "/dump_expert_distribution_record", json={"path": dump_path})
        assert r.status_code == 200 and r.json()["tokens"] > 0, r.text
    finally:
        live.stop()
    return outs


def _record_offline(path: str, overrides: list[str], prompts: list[list[int]],
                    dump_path: str) -> list[list[int]]:
    """The same record → load → dump on an offline Engine (control ops on every rank)."""
    with Engine(path, overrides) as eng:
        assert all(r["ok"] for r in eng.control("expert_record_start"))
        outs = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=GREEDY)]
        merge_rank_dumps(eng.control("expert_record_dump"), {"model": path}).save(dump_path)
    return outs


def _measured_balancedness(dump_path: str) -> float:
    """From the recorded physical counts: tokens each rank's experts processed, mean/max."""
    dump = load_dump(dump_path)
    counts = dump.physical_counts.float()  # [L, P]
    per_rank = counts.view(counts.shape[0], 2, -1).sum(-1)  # [L, ep]
    return float(balancedness(per_rank).mean())


def test_record_dump_report_rebalance_restart(tiny_model, tmp_path, capsys):
    path = tiny_model("qwen3_moe")
    rng = random.Random(0)
    hot = [rng.randrange(100, 3000) for _ in range(12)]  # a shared prefix skews the routing
    prompts = [hot + [rng.randrange(100, 3000) for _ in range(rng.randrange(2, 10))]
               for _ in range(16)]
    base = [f"model.path={path}", *FP32_CPU, *DP2]
    first = str(tmp_path / "dump.pt")
    before_outs = _record(base, prompts, first)
    dump = load_dump(first)
    tokens = sum(len(p) for p in prompts) + 16 * (GREEDY["max_new_tokens"] - 1)
    assert int(dump.physical_counts[0].sum()) == 2 * tokens  # top-2, every token counted once
    assert eplb_main(["report", first]) == 0
    report = capsys.readouterr().out
    assert "bal eplb" in report and "ep=2" in report
    placement = str(tmp_path / "placement.json")
    assert eplb_main(["rebalance", first, "--ep-size", "2", "--nodes", "1", "--redundant", "2",
                      "-o", placement]) == 0
    second = str(tmp_path / "dump2.pt")
    after_outs = _record_offline(path, [*FP32_CPU, *DP2, "eplb.num_redundant_experts=2",
                                        f"eplb.init_placement={placement}"], prompts, second)
    assert after_outs == before_outs
    assert torch.equal(load_dump(second).logical_load(), dump.logical_load())  # same workload
    assert _measured_balancedness(second) > _measured_balancedness(first)
