"""`python -m moeserve.bench.soak`: sustained load with injected client disconnects.

C concurrent streams of greedy `/v1/completions` requests (token-id prompts from a fixed seeded
pool, `ignore_eos`, fixed lengths) for `--minutes`; a `--disconnect` share of them (default 20%)
hang up at a random point, half before the first token (during prefill) and half mid-stream.
Checks: every request completes or is an injected disconnect (failed = any HTTP error, a stream
without its end, or a completed text that differs from the unloaded run of the same prompt, done
first, one at a time); afterwards no request is left in the server and every rank's memory is
clean. `--mix` sends a share of the prompts as structured (`regex`) or `n`=2 requests (each
choice's text must equal the unloaded run's). Prints the RSS and open-fd series of the server's
process tree (every `--sample-s`),
p50/p99 TTFT and ITL, counts and the ranks' KV retractions. With `--launch` it starts its own
server (the overrides that follow, e.g. a small `cache.max_total_tokens` to force retraction):

    python -m moeserve.bench.soak --minutes 10 --concurrency 256 --launch \\
        model.dtype=float32 cache.max_total_tokens=4000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np


@dataclass
class SoakReport:
    completed: int = 0
    aborted_prefill: int = 0  # injected disconnects before the first token
    aborted_stream: int = 0  # injected disconnects mid-stream
    failed: list[str] = field(default_factory=list)
    mismatched: int = 0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    series: list[tuple[float, float, int]] = field(default_factory=list)  # (s, RSS MiB, fds)
    retractions: int = 0
    leftover: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        pct = {f"{name}_p{q}_ms": round(float(np.percentile(v, q)) * 1000, 1) if v else None
               for name, v in (("ttft", self.ttft), ("itl", self.itl)) for q in (50, 99)}
        return {"completed": self.completed, "aborted_prefill": self.aborted_prefill,
                "aborted_stream": self.aborted_stream, "failed": len(self.failed),
                "mismatched": self.mismatched, "retractions": self.retractions, **pct,
                "rss_mib": [self.series[0][1], self.series[-1][1]] if self.series else None,
                "fds": [self.series[0][2], self.series[-1][2]] if self.series else None,
                "leftover": self.leftover}


KINDS = ("plain", "regex", "n2")  # --mix: a structured request, or two choices in one request
REGEX = "[a-z]{2,6}( [a-z]{2,6})*"


def make_prompts(n: int, vocab: int, seed: int, lens: tuple[int, int],
                 outs: tuple[int, int], mix: float = 0.0) -> list[tuple[list[int], int, str]]:
    """(prompt ids, max_tokens, kind) for each pool entry; a `mix` share is regex or n2."""
    rng = random.Random(seed)
    pool = []
    for _ in range(n):
        ids = [rng.randrange(3, vocab) for _ in range(rng.randint(*lens))]
        kind = rng.choice(KINDS[1:]) if rng.random() < mix else "plain"
        pool.append((ids, rng.randint(*outs), kind))
    return pool


async def stream_completion(client: httpx.AsyncClient, body: dict, hang_up: str | None,
                            rng: random.Random, report: SoakReport | None) -> str | None:
    """One streamed completion → its text (None when it hung up on purpose); raises on errors.
    `hang_up`: None, "prefill" (leave before the first token) or "stream" (after a few)."""
    start = last = time.perf_counter()
    texts: dict[int, list[str]] = {}  # by choice index
    ends: set[int] = set()
    chunks, done = 0, False
    stop_after = rng.randint(1, max(1, body["max_tokens"] - 1))
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        if hang_up == "prefill":
            return None  # the response headers are sent before any token: leave now
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                break
            event = json.loads(data)
            if "error" in event:
                raise RuntimeError(f"error event: {event['error']}")
            for choice in event.get("choices") or []:
                now = time.perf_counter()
                if choice.get("text"):
                    if report is not None:
                        (report.itl if chunks else report.ttft).append(now - (last if chunks
                                                                               else start))
                    chunks, last = chunks + 1, now
                    texts.setdefault(choice.get("index", 0), []).append(choice["text"])
                if choice.get("finish_reason") is not None:
                    ends.add(choice.get("index", 0))
            if hang_up == "stream" and chunks >= stop_after:
                return None
    n = body.get("n", 1)
    if not (done and len(ends) == n):
        raise RuntimeError(f"stream ended early (done {done}, {len(ends)}/{n} choices finished)")
    return "\x00".join("".join(texts.get(i, [])) for i in range(n))


def _body(model: str, prompt: list[int], max_tokens: int, kind: str = "plain") -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}
    if kind == "regex":
        body["regex"] = REGEX
    elif kind == "n2":
        body["n"] = 2
    return body


async def unloaded(client: httpx.AsyncClient, model: str, prompts: list) -> list[str]:
    """The reference: each prompt alone, one at a time."""
    rng = random.Random(0)
    return [await stream_completion(client, _body(model, *entry), None, rng, None)
            for entry in prompts]


async def soak(url: str, minutes: float, concurrency: int, disconnect: float, pid: int | None,
               prompts: int = 64, seed: int = 0, sample_s: float = 5.0,
               lens: tuple[int, int] = (8, 96), outs: tuple[int, int] = (8, 64),
               mix: float = 0.0, request_timeout_s: float = 300.0) -> SoakReport:
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(request_timeout_s),
                                 limits=limits) as client:
        info = (await client.get("/get_model_info")).json()
        model = info["served_model_name"]
        pool = make_prompts(prompts, min(info["vocab_size"], 30000), seed, lens, outs, mix)
        expected = await unloaded(client, model, pool)
        report, deadline = SoakReport(), time.monotonic() + minutes * 60
        sampler = asyncio.create_task(_sample(pid, sample_s, report))
        await asyncio.gather(*(_worker(client, model, pool, expected, disconnect, deadline,
                                       random.Random(seed * 1000 + w), report)
                               for w in range(concurrency)))
        sampler.cancel()
        _sample_once(pid, report, time.monotonic())
        report.leftover, report.retractions = await _leftover(client)
    return report


async def _worker(client, model, pool, expected, disconnect, deadline, rng, report) -> None:
    while time.monotonic() < deadline:
        i = rng.randrange(len(pool))
        hang_up = (rng.choice(["prefill", "stream"]) if rng.random() < disconnect else None)
        try:
            text = await stream_completion(client, _body(model, *pool[i]), hang_up, rng, report)
        except Exception as e:  # noqa: BLE001 - every failure is counted, none stops the run
            report.failed.append(f"{type(e).__name__}: {e}"[:300])
            continue
        if text is None:
            if hang_up == "prefill":
                report.aborted_prefill += 1
            else:
                report.aborted_stream += 1
        elif text == expected[i]:
            report.completed += 1
        else:
            report.mismatched += 1
            report.failed.append(f"prompt {i}: output differs from the unloaded run")


_T0 = time.monotonic()


async def _sample(pid: int | None, every: float, report: SoakReport) -> None:
    while True:
        _sample_once(pid, report, time.monotonic())
        await asyncio.sleep(every)


def _sample_once(pid: int | None, report: SoakReport, now: float) -> None:
    """RSS (MiB) and open fds summed over the server process and its children."""
    if pid is None:
        return
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
        rss = sum(p.memory_info().rss for p in procs) / 2**20
        fds = sum(p.num_fds() for p in procs)
    except psutil.Error:
        return
    report.series.append((round(now - _T0, 1), round(rss, 1), fds))


async def _leftover(client: httpx.AsyncClient, settle_s: float = 30.0) -> tuple[list[str], int]:
    """(what the server still holds once the load stopped, total KV retractions)."""
    deadline, problems, retractions = time.monotonic() + settle_s, ["not checked"], 0
    while problems and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
        info = (await client.get("/server_info")).json()
        retractions = sum(r.get("retractions", 0) for r in info["ranks"])
        problems = [f"{info['inflight']} request(s) in flight"] if info["inflight"] else []
        problems += [f"rank {r['rank']} running {r['running']} waiting {r['waiting']} memory "
                     f"clean {r.get('memory_clean')}" for r in info["ranks"]
                     if r["running"] or r["waiting"] or not r.get("memory_clean", True)]
    return problems, retractions


def print_report(report: SoakReport, out: Any = sys.stdout) -> None:
    print("t_s  rss_mib  open_fds", file=out)
    for t, rss, fds in report.series:
        print(f"{t:6.1f} {rss:8.1f} {fds:6d}", file=out)
    for line in report.failed[:20]:
        print("FAILED", line, file=out)
    print(json.dumps(report.summary()), file=out)


def launch_server(overrides: list[str], stdout: Any = None) -> tuple[subprocess.Popen, str]:
    """`python -m launch.server` on a free loopback port, waited for until /health answers
    (bench.elastic starts its servers here too); `stdout`: where its output goes."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "launch.server", f"server.port={port}",
                             *overrides], stdout=stdout, stderr=stdout)
    url = f"http://127.0.0.1:{port}"
    for _ in range(1200):
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}: {overrides}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise SystemExit("the server did not become healthy")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:30000")
    ap.add_argument("--pid", type=int, default=None, help="server pid (RSS/fd series)")
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--disconnect", type=float, default=0.2)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mix", type=float, default=0.0,
                    help="share of prompts sent as regex-constrained or n=2 requests")
    ap.add_argument("--launch", nargs=argparse.REMAINDER, default=None,
                    help="start a server with these Hydra overrides (must come last)")
    args = ap.parse_args(argv)
    proc, url, pid = None, args.url, args.pid
    if args.launch is not None:
        proc, url = launch_server(args.launch)
        pid = proc.pid
    try:
        report = asyncio.run(soak(url, args.minutes, args.concurrency, args.disconnect, pid,
                                  args.prompts, args.seed, mix=args.mix))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    print_report(report)
    return 1 if report.failed or report.leftover else 0


if __name__ == "__main__":
    sys.exit(main())
