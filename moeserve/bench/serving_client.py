"""The benchmark's client side: one streamed request (`send_request`), a set of requests under a
concurrency cap and Poisson arrivals (`drive`), and the same split over worker processes
(`drive_in_workers`).

Why workers: one Python process streaming 256 answers over httpx spends ~160 µs of CPU per SSE
chunk (httpx/h11 parsing), so at ~5k chunks/s its event loop is mostly busy and late: a request
it should send waited ~0.4 s in the client (traced against the server's handler on a 2-core CPU),
TTFT looked ~0.9 s where the server saw ~0.2 s, and the server ran fewer requests than the
concurrency asked for. Each worker drives its share of the requests with its share of the
concurrency and of the arrival rate, all from one start time.
"""

from __future__ import annotations

import asyncio
import json
import math
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

from moeserve.bench.serving_data import _encode


@dataclass
class RequestResult:
    success: bool = False
    latency: float = 0.0  # seconds, send → last byte
    ttft: float = 0.0  # seconds, send → first content chunk
    itl: list[float] = field(default_factory=list)  # gaps between content chunks
    generated_text: str = ""
    output_tokens: int = 0
    usage_output_tokens: int | None = None
    usage_prompt_tokens: int | None = None
    prompt_len: int = 0
    requested_output_len: int = 0
    chunks: int = 0
    got_done: bool = False
    error: str = ""
    start: float = 0.0  # perf_counter at send


def _chunk_text(choice: dict, chat: bool) -> str:
    if not chat:
        return choice.get("text") or ""
    delta = choice.get("delta") or choice.get("message") or {}
    return (delta.get("reasoning_content") or "") + (delta.get("content") or "")


def _take_usage(res: RequestResult, usage: Any) -> None:
    if isinstance(usage, dict):
        if usage.get("completion_tokens") is not None:
            res.usage_output_tokens = int(usage["completion_tokens"])
        if usage.get("prompt_tokens") is not None:
            res.usage_prompt_tokens = int(usage["prompt_tokens"])


async def send_request(client: httpx.AsyncClient, url: str, body: dict, chat: bool,
                       headers: dict) -> RequestResult:
    """One request; streams when body["stream"]. Never raises: failures set `error`."""
    res = RequestResult()
    start = res.start = time.perf_counter()
    last = start
    try:
        if not body.get("stream"):
            resp = await client.post(url, json=body, headers=headers)
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {resp.text[:500]}"
                return res
            data = resp.json()
            res.latency = res.ttft = time.perf_counter() - start
            res.generated_text = "".join(_chunk_text(c, chat) for c in data.get("choices") or [])
            _take_usage(res, data.get("usage"))
            res.success = True
            return res
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode("utf-8", "replace")
                res.error = f"HTTP {resp.status_code}: {text[:500]}"
                return res
            parts: list[str] = []
            async for line in resp.aiter_lines():
                line = line.strip()
                if not line.startswith("data:"):
                    continue  # blank separators, comments (": ping"), event:/id: fields
                data_str = line[5:].strip()
                if data_str == "[DONE]":
                    res.got_done = True
                    break
                try:
                    chunk = json.loads(data_str)
                except json.JSONDecodeError:
                    continue
                if chunk.get("error"):
                    res.error = f"stream error: {json.dumps(chunk['error'])[:500]}"
                    return res
                _take_usage(res, chunk.get("usage"))
                text = "".join(_chunk_text(c, chat) for c in chunk.get("choices") or [])
                if not text:
                    continue
                now = time.perf_counter()
                if res.chunks == 0:
                    res.ttft = now - start
                else:
                    res.itl.append(now - last)
                last = now
                res.chunks += 1
                parts.append(text)
            # A server may close the stream without `data: [DONE]` (transformers serve does).
        res.latency = time.perf_counter() - start
        res.generated_text = "".join(parts)
        res.success = True
    except Exception as e:  # noqa: BLE001 — report, don't crash the run
        res.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    return res


def count_output_tokens(res: RequestResult, tokenizer) -> int:
    """usage.completion_tokens if sent, else the re-tokenized text, else the chunk count."""
    if res.usage_output_tokens is not None:
        return res.usage_output_tokens
    if tokenizer is not None:
        return len(_encode(tokenizer, res.generated_text)) if res.generated_text else 0
    return res.chunks if res.chunks else (1 if res.generated_text else 0)


@dataclass
class Drive:
    """One client's share of a run (picklable: it travels to a worker process)."""

    url: str
    bodies: list[dict]
    chat: bool
    headers: dict
    concurrency: int | None  # None: no cap
    request_rate: float  # req/s; inf: all at once
    seed: int
    request_timeout: float


def http_client(connections: int, request_timeout: float) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    return httpx.AsyncClient(timeout=httpx.Timeout(request_timeout, connect=30.0), limits=limits,
                             trust_env=False)


async def drive(d: Drive, client: httpx.AsyncClient,
                start_at: float | None = None) -> tuple[list[RequestResult], float, float]:
    """Send d's requests (arrival gaps drawn from d.seed) → (results in order, perf_counter at
    the start, at the end). `start_at`: a time.time() to wait for first (workers start
    together)."""
    if start_at is not None:
        await asyncio.sleep(max(0.0, start_at - time.time()))
    sem = asyncio.Semaphore(d.concurrency) if d.concurrency else None
    rng = np.random.default_rng(d.seed)

    async def one(body: dict) -> RequestResult:
        if sem is None:
            return await send_request(client, d.url, body, d.chat, d.headers)
        async with sem:
            return await send_request(client, d.url, body, d.chat, d.headers)

    tasks = []
    t0 = time.perf_counter()
    for i, body in enumerate(d.bodies):
        if i and math.isfinite(d.request_rate) and d.request_rate > 0:
            await asyncio.sleep(float(rng.exponential(1.0 / d.request_rate)))
        tasks.append(asyncio.create_task(one(body)))
    results = await asyncio.gather(*tasks)
    return list(results), t0, time.perf_counter()


def split(d: Drive, n: int) -> list[Drive]:
    """n shares: requests round-robin, the concurrency and arrival rate divided (a sum of
    Poisson processes is one of the summed rate)."""
    shares = []
    for i in range(n):
        cap = None if not d.concurrency else d.concurrency // n + (i < d.concurrency % n)
        shares.append(Drive(d.url, d.bodies[i::n], d.chat, d.headers, cap, d.request_rate / n,
                            d.seed + 1000 * i, d.request_timeout))
    return shares


def _worker(d: Drive, start_at: float) -> tuple[list[RequestResult], float, float]:
    async def run():
        async with http_client((d.concurrency or len(d.bodies)) + 4, d.request_timeout) as c:
            return await drive(d, c, start_at)
    return asyncio.run(run())


def _ready() -> bool:
    time.sleep(0.3)  # busy long enough that the pool starts every worker, not one for all
    return True


async def drive_in_workers(d: Drive, workers: int) -> tuple[list[RequestResult], float, float]:
    """d split over `workers` spawned processes started together → (results in d's order,
    earliest start, latest end)."""
    shares = split(d, workers)
    ctx = multiprocessing.get_context("spawn")
    loop = asyncio.get_running_loop()
    with ProcessPoolExecutor(workers, mp_context=ctx) as pool:
        await asyncio.gather(*[loop.run_in_executor(pool, _ready) for _ in range(workers)])
        start_at = time.time() + 0.5  # every worker has imported and waits for this moment
        outs = await asyncio.gather(*[loop.run_in_executor(pool, _worker, s, start_at)
                                      for s in shares])
    results: list[RequestResult | None] = [None] * len(d.bodies)
    for i, (res, _, _) in enumerate(outs):
        results[i::workers] = res
    return results, min(o[1] for o in outs), max(o[2] for o in outs)  # type: ignore[return-value]
