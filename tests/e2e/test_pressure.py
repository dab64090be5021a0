"""64 concurrent requests through HTTP into a KV pool far too small for them: retraction kicks in,
every request completes with the same greedy tokens as a sequential run, clients that disconnect
mid-stream are aborted, and the pool returns to its baseline (nothing held but evictable cache)."""

from __future__ import annotations

import asyncio
import random
import time

import pytest
from live_server import LiveServer
from parity import FP32_CPU

from moeserve import Engine

import httpx

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

N, MAX_NEW = 64, 24
SMALL_KV = ["cache.max_total_tokens=400", "scheduler.init_new_token_ratio=0.05",
            "scheduler.min_new_token_ratio=0.01"]


@pytest.fixture(scope="module")
def setup(tiny_model):
    path = tiny_model("llama")
    rng = random.Random(7)
    prompts = [[rng.randrange(100, 5000) for _ in range(rng.randrange(4, 20))] for _ in range(N)]
    params = {"temperature": 0, "ignore_eos": True, "max_new_tokens": MAX_NEW}
    with Engine(path, FP32_CPU + ["scheduler.overlap=false"]) as eng:
        expected = [eng.generate(input_ids=[p], sampling_params=params)[0]["output_ids"]
                    for p in prompts]
    live = LiveServer([f"model.path={path}", *FP32_CPU, *SMALL_KV]).wait_healthy()
    yield live, prompts, expected
    live.stop()


async def _generate(client, ids: list[int]) -> list[int]:
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "ignore_eos": True,
                                                  "max_new_tokens": MAX_NEW}}
    r = await client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


async def _disconnect_after(client, ids: list[int], chunks: int) -> None:
    body = {"model": "x", "prompt": ids, "max_tokens": MAX_NEW, "temperature": 0,
            "stream": True}
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        seen = 0
        async for line in resp.aiter_lines():
            seen += line.startswith("data: ")
            if seen >= chunks:
                return  # closing the stream mid-way


def _info(url: str) -> list[dict]:
    ranks = httpx.get(url + "/server_info", timeout=10).json()["ranks"]
    return ranks


def _wait_drained(url: str, timeout: float = 60.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        ranks = _info(url)
        if all(r["running"] == 0 and r["waiting"] == 0 and r["used_tokens"] == 0 for r in ranks):
            return ranks
        if time.monotonic() > deadline:
            return ranks
        time.sleep(0.5)


def test_all_complete_under_retraction(setup):
    live, prompts, expected = setup

    async def run():
        async with httpx.AsyncClient(base_url=live.url, timeout=300) as c:
            return await asyncio.gather(*[_generate(c, p) for p in prompts])

    outs = asyncio.run(run())
    assert outs == expected
    ranks = _wait_drained(live.url)
    assert ranks[0]["retractions"] > 0, ranks
    assert ranks[0]["used_tokens"] == 0 and ranks[0]["running"] == 0, ranks


def test_disconnects_under_pressure_free_everything(setup):
    live, prompts, expected = setup

    async def run():
        async with httpx.AsyncClient(base_url=live.url, timeout=300) as c:
            keep = [_generate(c, p) for p in prompts[::2]]
            drop = [_disconnect_after(c, p, 3) for p in prompts[1::2]]
            results = await asyncio.gather(*keep, *drop)
            return results[: len(keep)]

    outs = asyncio.run(run())
    assert outs == expected[::2]
    ranks = _wait_drained(live.url)
    assert ranks[0]["used_tokens"] == 0 and ranks[0]["running"] == 0, ranks
    assert ranks[0]["waiting"] == 0, ranks
