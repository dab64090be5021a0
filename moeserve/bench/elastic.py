"""Elastic EP's cost when nothing fails, and its recovery when a rank dies (docs/elastic_ep.md).

Starts two servers of the same deployment, `parallel.elastic_ep=false` and `true`, both up for the
whole run, and sends them the same greedy load in alternating rounds (A B A B ...), so drift of a
shared machine hits both alike; prints output tokens/s and latency per mode, and the slowdown.
With --kill, one more round on the elastic server `kill -9`s a rank mid-load and reports the
recovery time (death seen -> first step on the new group, /metrics), the time until every request
finished, and how many completed, were resumed or failed.

  python -m moeserve.bench.elastic --model PATH [--streams 64 --tokens 48 --rounds 5 --kill]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

from moeserve.bench.soak import launch_server

DEPLOY = ["model.dtype=float32", "parallel.tp_size=4", "parallel.dp_size=4",
          "scheduler.cpu_threads=1", "server.log_level=warning"]


def launch(overrides: list[str]) -> tuple[subprocess.Popen, str]:
    run_dir = tempfile.mkdtemp(prefix="moeserve-bench-elastic-")
    return launch_server([f"hydra.run.dir={run_dir}", *overrides], stdout=subprocess.DEVNULL)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 3000) for _ in range(rng.randrange(8, 32))] for _ in range(n)]


async def one_round(url: str, ids: list[list[int]], tokens: int, kill=None) -> dict:
    params = {"temperature": 0, "ignore_eos": True, "max_new_tokens": tokens}
    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        async def one(p: list[int]) -> tuple[float, int, bool]:
            t0 = time.perf_counter()
            r = await c.post("/generate", json={"input_ids": p, "sampling_params": params})
            ok = r.status_code == 200
            return time.perf_counter() - t0, len(r.json()["output_ids"]) if ok else 0, ok

        t0 = time.perf_counter()
        tasks = [asyncio.create_task(one(p)) for p in ids]
        t_kill = None
        if kill is not None:
            await asyncio.sleep(1.0)
            t_kill = time.perf_counter()
            await asyncio.to_thread(kill)
        done = await asyncio.gather(*tasks)
        end = time.perf_counter()
    return {"wall": end - t0, "tokens": sum(d[1] for d in done),
            "lat": [d[0] for d in done], "ok": sum(d[2] for d in done),
            "after_kill": None if t_kill is None else end - t_kill}


def metric(url: str, name: str) -> float:
    m = re.search(rf"^moeserve:elastic_{re.escape(name)} (\S+)$",
                  httpx.get(url + "/metrics", timeout=30).text, re.M)
    return float(m.group(1)) if m else 0.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="checkpoint folder (a tiny MoE on CPU)")
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--timeout-s", type=float, default=5.0, help="parallel.elastic_timeout_s")
    ap.add_argument("--kill", action="store_true", help="also kill -9 a rank in one more round")
    ap.add_argument("--set", action="append", default=[], help="extra Hydra overrides")
    args = ap.parse_args(argv)
    keys = {o.split("=", 1)[0] for o in args.set}
    base = [f"model.path={args.model}", *[o for o in DEPLOY if o.split("=", 1)[0] not in keys],
            *args.set]
    servers = {False: launch([*base, "parallel.elastic_ep=false"]),
               True: launch([*base, "parallel.elastic_ep=true",
                             f"parallel.elastic_timeout_s={args.timeout_s}"])}
    try:
        ids = prompts(args.streams)
        results: dict[bool, list[dict]] = {False: [], True: []}
        for mode in (False, True):  # warm-up round each (kernels, caches)
            asyncio.run(one_round(servers[mode][1], ids, args.tokens))
        for r in range(args.rounds):
            for mode in ((False, True) if r % 2 == 0 else (True, False)):
                results[mode].append(asyncio.run(one_round(servers[mode][1], ids, args.tokens)))
        print(f"\n{args.streams} greedy streams x {args.tokens} tokens, dp x ep, "
              f"{args.rounds} alternating rounds (median)")
        print("| elastic_ep | output tok/s | p50 latency s | p99 latency s | vs off |")
        print("|---|---|---|---|---|")
        tput = {m: statistics.median(x["tokens"] / x["wall"] for x in rs)
                for m, rs in results.items()}
        for mode, rs in results.items():
            lats = sorted(t for x in rs for t in x["lat"])
            print(f"| {str(mode).lower()} | {tput[mode]:.1f} | {lats[len(lats) // 2]:.2f} | "
                  f"{lats[int(len(lats) * 0.99)]:.2f} | "
                  f"{100 * (tput[mode] / tput[False] - 1):+.1f}% |")
        if args.kill:
            proc, url = servers[True]
            ready = httpx.get(url + "/server_info", timeout=60).json()["ready"]
            victim = max(int(k.split(":")[1]) for k in ready if k.startswith("scheduler:"))
            pid = ready[f"scheduler:{victim}"]["elastic_pid"]
            res = asyncio.run(one_round(url, ids, args.tokens,
                                        kill=lambda: os.kill(pid, signal.SIGKILL)))
            print(f"\nkill -9 rank {victim} one second into the round (elastic_timeout_s "
                  f"{args.timeout_s}):")
            print("| completed | resumed | failed | recovery s (death seen -> first step) | "
                  "kill -> all done s |")
            print("|---|---|---|---|---|")
            print(f"| {res['ok']}/{len(ids)} | {metric(url, 'requests_retried_total'):.0f} | "
                  f"{metric(url, 'requests_failed_total'):.0f} | "
                  f"{metric(url, 'last_recovery_seconds'):.2f} | {res['after_kill']:.1f} |")
    finally:
        for proc, _ in servers.values():
            proc.send_signal(signal.SIGTERM)
        for proc, _ in servers.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
