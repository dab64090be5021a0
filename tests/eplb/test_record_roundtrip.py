"""Record under load → dump over HTTP → report → rebalance → restart with the placement: the
placement's balancedness on the same workload is better than the trivial one, and outputs match."""

from __future__ import annotations

import asyncio
import random

import pytest
from live_server import LiveServer
from parity import FP32_CPU

from moeserve.eplb.algorithm import balancedness, rank_load, trivial_rank_load
from moeserve.eplb.cli import main as eplb_main
from moeserve.eplb.location import ExpertLocation
from moeserve.eplb.recorder import load_dump

try:
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


async def _load(url: str, prompts: list[list[int]]) -> list[list[int]]:
    body = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 8}
    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        rs = await asyncio.gather(*[c.post("/generate", json={"input_ids": p,
                                                              "sampling_params": body})
                                    for p in prompts])
    return [r.json()["output_ids"] for r in rs]


def test_record_dump_report_rebalance_restart(tiny_model, tmp_path, capsys):
    path = tiny_model("qwen3_moe")
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 3000) for _ in range(rng.randrange(5, 30))] for _ in range(16)]
    live = LiveServer([f"model.path={path}", *FP32_CPU]).wait_healthy()
    try:
        assert httpx.post(live.url + "/start_expert_distribution_record").status_code == 200
        before = asyncio.run(_load(live.url, prompts))
        dump_path = str(tmp_path / "dump.pt")
        r = httpx.post(live.url + "/dump_expert_distribution_record", json={"path": dump_path})
        assert r.status_code == 200 and r.json()["tokens"] > 0, r.text
        assert httpx.post(live.url + "/stop_expert_distribution_record").status_code == 200
    finally:
        live.stop()
    dump = load_dump(dump_path)
    # every routed token was counted: top-2 per token per MoE layer
    prompt_and_decode = sum(len(p) for p in prompts) + 16 * 7
    assert int(dump.physical_counts[0].sum()) == 2 * prompt_and_decode
    assert eplb_main(["report", dump_path]) == 0
    report = capsys.readouterr().out
    assert "bal eplb" in report and "layers=2" in report
    placement = str(tmp_path / "placement.json")
    eplb_main(["rebalance", dump_path, "--ep-size", "2", "--nodes", "1", "--redundant", "2",
               "-o", placement])
    loc = ExpertLocation.load(placement)
    load = dump.logical_load().float()
    after = balancedness(rank_load(loc.physical_to_logical, load, loc.logical_count, 2)).mean()
    trivial = balancedness(trivial_rank_load(load, 2)).mean()
    assert after > trivial
    # restart from the dump (rebalanced for this single-rank layout, 2 redundant experts)
    live = LiveServer([f"model.path={path}", *FP32_CPU, "eplb.num_redundant_experts=2",
                       f"eplb.init_placement={dump_path}"]).wait_healthy()
    try:
        assert asyncio.run(_load(live.url, prompts)) == before
    finally:
        live.stop()
