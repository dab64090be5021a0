"""Live EPLB rebalance while 32 requests are in flight (half of them streaming) on dp2 x ep2 with
redundant experts: every request succeeds and greedy outputs equal a single process without any
placement."""

from __future__ import annotations

import asyncio
import json
import random
import time

import pytest
from live_server import LiveServer
from parity import FP32_CPU

from moeserve import Engine

import httpx

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]
GREEDY = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 24}


def test_live_rebalance_under_streaming_load(tiny_model):
    path = tiny_model("deepseek_v3")
    rng = random.Random(3)
    prompts = [[rng.randrange(100, 3000) for _ in range(rng.randrange(5, 25))] for _ in range(32)]
    with Engine(path, FP32_CPU) as eng:
        expected = [o["output_ids"] for o in eng.generate(input_ids=prompts,
                                                            sampling_params=GREEDY)]
    live = LiveServer([f"model.path={path}", *FP32_CPU, "parallel.tp_size=2",
                       "parallel.dp_size=2", "eplb.num_redundant_experts=2",
                       "eplb.record_mode=stat"]).wait_healthy()

    async def run():
        async with httpx.AsyncClient(base_url=live.url, timeout=300) as c:
            async def one(p):
                r = await c.post("/generate", json={"input_ids": p, "sampling_params": GREEDY})
                assert r.status_code == 200, r.text
                return r.json()["output_ids"]

            async def streamed(p):  # cumulative ids per event; the last one is the result
                body = {"input_ids": p, "sampling_params": GREEDY, "stream": True}
                last = None
                async with c.stream("POST", "/generate", json=body) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            last = json.loads(line[6:])
                return last["output_ids"]

            tasks = [asyncio.create_task(streamed(p) if i % 2 else one(p))
                     for i, p in enumerate(prompts)]
            await asyncio.sleep(1.0)  # mid-stream
            rebalanced = await c.post("/rebalance_experts")
            return await asyncio.gather(*tasks), rebalanced

    try:
        outs, rebalanced = asyncio.run(run())
        assert rebalanced.status_code == 200, rebalanced.text
        ranks = rebalanced.json()["ranks"]
        assert len(ranks) == 2 and ranks[0]["balancedness_after"] >= ranks[0]["balancedness_before"]
        assert sum(r["moved_slots"] for r in ranks) > 0  # weights really moved
        assert outs == expected
        info = httpx.get(live.url + "/server_info").json()["ranks"]
        assert all(r["eplb_rebalances"] == 1 for r in info)
        deadline = time.monotonic() + 30  # the next load report carries it to /metrics
        while 'moeserve:eplb_balancedness{rank="0"}' not in (
                metrics := httpx.get(live.url + "/metrics").text):
            assert time.monotonic() < deadline, metrics
            time.sleep(0.2)
    finally:
        live.stop()
