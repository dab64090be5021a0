"""Inter-token latency of PD disaggregation against a colocated server, under a prefill-heavy mix.

    python -m moeserve.bench.pd_itl --model PATH [--streams 32 --duration 20 --long-tokens 3000]

Two setups on this host, one after the other: a colocated server pinned to `--colocated-cpus`, and
the one-command PD deployment (`launch.multinode +cluster=local +deploy=pd_tiny_cpu`) with its
prefill pinned to `--prefill-cpus` and its decode to `--decode-cpus` (disaggregation.prefill_cpus,
decode_cpus). Each runs two phases of `--duration` seconds: `decode-only` (`--streams` streamed
completions of `--decode-tokens` tokens each, restarted as they end) and `mix` (the same plus one
long prompt of about `--long-tokens` tokens every `--interval` seconds, each a new prefix).
ITL: the gaps between a stream's consecutive chunks (streamed `/generate`), after its first
(client side). Prints a table; the last column is the mix's p99 over the same setup's
decode-only p99 (target for PD: <= 1.2, docs/disaggregation.md). The preset runs the prefill at
nice 10 (`--prefill-nice 0`: as before it did). `--trace DIR`: the PD setup's
schedulers write their step timelines there, a sampler pinned to the prefill's cores records every
thread's CPU on the host, and a report says what ran on the decode core (bench/pd_trace.py).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

import httpx
import numpy as np

BASE = ["device=cpu", "model.dtype=float32", "server.startup_timeout_s=600"]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(kind: str, args: argparse.Namespace) -> tuple[subprocess.Popen, str, object]:
    """The setup's process (its own session: stopped as a group), its URL and log file."""
    port = free_port()
    common = [f"model.path={args.model}", f"model.context_length={args.context}", *BASE,
              f"hydra.run.dir={tempfile.mkdtemp(prefix=f'pd-itl-{kind}-')}"]
    if kind == "colocated":
        cmd = ["taskset", "-c", args.colocated_cpus, sys.executable, "-m", "launch.server",
               *common, f"server.port={port}",
               f"scheduler.cpu_threads={len(args.colocated_cpus.split(','))}"]
    else:
        cmd = [sys.executable, "-m", "launch.multinode", "+cluster=local", "+deploy=pd_tiny_cpu",
               *common, f"disaggregation.router_port={port}",
               f"disaggregation.prefill_cpus={args.prefill_cpus}",
               f"disaggregation.decode_cpus={args.decode_cpus}"]
        if args.frontend_cpus:
            cmd.append(f"disaggregation.frontend_cpus={args.frontend_cpus}")
        if args.prefill_nice is not None:
            cmd.append(f"disaggregation.prefill_nice={args.prefill_nice}")
    log = tempfile.NamedTemporaryFile("w+", prefix=f"pd-itl-{kind}-", suffix=".log", delete=False)
    env = dict(os.environ)
    if args.trace and kind == "pd":
        env["MOESERVE_STEP_TIMELINE"] = os.path.join(args.trace, "steps")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env=env)
    return proc, f"http://127.0.0.1:{port}", log


def wait_ready(proc: subprocess.Popen, url: str, log, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"setup exited {proc.returncode}; log {log.name}")
        try:
            r = httpx.post(url + "/generate", timeout=30, json={
                "text": "warm", "sampling_params": {"max_new_tokens": 2}})
            if r.status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"setup not ready after {timeout} s; log {log.name}")


def stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


async def stream(client: httpx.AsyncClient, url: str, prompt: str, tokens: int,
                 gaps: list[float] | None, marks: list | None = None) -> None:
    """One streamed completion; the gaps between its chunks (after the first) into `gaps`;
    `marks` (tracing) gets (wall time, gap) per gap, or (sent, first chunk) for a long prompt."""
    body = {"text": prompt, "stream": True, "sampling_params": {
        "max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}}
    last, sent = None, time.time()
    async with client.stream("POST", url + "/generate", json=body) as resp:
        if resp.status_code != 200:
            raise SystemExit(f"{url}: {resp.status_code} {(await resp.aread())[:500]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            if last is not None and gaps is not None:
                gaps.append(now - last)
                if marks is not None:
                    marks.append(("gap", time.time(), now - last))
            elif last is None and gaps is None and marks is not None:
                marks.append(("long", sent, time.time()))
            last = now


async def phase(url: str, args: argparse.Namespace, mix: bool,
                marks: list | None = None) -> tuple[list[float], int]:
    """→ (ITL gaps of the decoding streams, long prompts sent)."""
    gaps: list[float] = []
    end = time.perf_counter() + args.duration
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "river", "mountain", "cloud", "stone", "light"]

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=256)) as c:
        async def decoder(i: int) -> None:
            while time.perf_counter() < end:
                await stream(c, url, f"Stream {i} tells a story:", args.decode_tokens, gaps,
                             marks)

        async def prefiller() -> int:
            sent, tasks = 0, []
            while time.perf_counter() < end:
                text = f"{rng.random()} " + " ".join(rng.choice(words)
                                                     for _ in range(args.long_tokens))
                tasks.append(asyncio.create_task(stream(c, url, text, 2, None, marks)))
                sent += 1
                await asyncio.sleep(args.interval)
            await asyncio.gather(*tasks)
            return sent

        jobs = [decoder(i) for i in range(args.streams)]
        if mix:
            results = await asyncio.gather(prefiller(), *jobs)
            return gaps, results[0]
        await asyncio.gather(*jobs)
        return gaps, 0


def sample_cpus(args: argparse.Namespace, name: str) -> tuple[subprocess.Popen, str]:
    """The host-wide thread sampler for one phase, on the prefill's cores (not the decode's)."""
    out = os.path.join(args.trace, f"cpu-{name}.jsonl")
    return subprocess.Popen(["taskset", "-c", args.prefill_cpus, sys.executable, "-m",
                             "moeserve.bench.pd_trace", "sample", "--out", out, "--seconds",
                             str(args.duration + 1)]), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--long-tokens", type=int, default=3000, help="words (about tokens) per long "
                    "prompt")
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--colocated-cpus", default="0,1")
    ap.add_argument("--prefill-cpus", default="0")
    ap.add_argument("--decode-cpus", default="1")
    ap.add_argument("--frontend-cpus", help="PD: disaggregation.frontend_cpus (default: none)")
    ap.add_argument("--prefill-nice", type=int, help="PD: disaggregation.prefill_nice")
    ap.add_argument("--client-cpus", help="pin this client while it measures (default: not)")
    ap.add_argument("--setups", nargs="+", default=["colocated", "pd"])
    ap.add_argument("--trace", help="directory: trace the PD setup's decode core (see above)")
    args = ap.parse_args()
    rows, traced, all_cpus = [], None, os.sched_getaffinity(0)
    if args.trace:
        os.makedirs(args.trace, exist_ok=True)
    for kind in args.setups:
        proc, url, log = start(kind, args)
        try:
            wait_ready(proc, url, log)
            tracing = args.trace and kind == "pd"
            if tracing:
                from moeserve.bench import pd_trace

                prefix = os.path.join(args.trace, "steps")
                labels = pd_trace.process_labels(proc.pid, os.getpid(),
                                                 pd_trace.timeline_pids(prefix))
                traced = (prefix, [], labels)
                dec = pd_trace.decode_url(log.name)
            base = None
            if args.client_cpus:  # after the setup started: its processes keep their own
                os.sched_setaffinity(0, {int(c) for c in args.client_cpus.split(",")})
            for name, mix in (("decode-only", False), ("mix", True)):
                sampler = sample_cpus(args, name) if tracing else None
                t0, marks = time.time(), [] if tracing else None
                before = pd_trace.itl_buckets(dec) if tracing and dec else {}
                gaps, longs = asyncio.run(phase(url, args, mix, marks))
                if sampler is not None:
                    after = pd_trace.itl_buckets(dec) if dec else {}
                    hist = {k: v - before.get(k, 0) for k, v in after.items()}
                    traced[1].append((name, t0, time.time(), sampler[1], marks, hist))
                    sampler[0].wait()
                p50, p99 = (float(np.percentile(gaps, q)) * 1e3 for q in (50, 99))
                base = p99 if base is None else base
                rows.append((kind, name, len(gaps) / args.duration, longs, p50, p99, p99 / base))
        finally:
            os.sched_setaffinity(0, all_cpus)
            stop(proc)
    if traced is not None:
        pd_trace.save(args.trace, *traced)
        pd_trace.report(*traced, decode_core=int(args.decode_cpus.split(",")[0]))
    print(f"{args.streams} streams x {args.decode_tokens} tokens; mix: +1 prompt of ~"
          f"{args.long_tokens} tokens every {args.interval:g} s; {args.duration:g} s per phase")
    print(f"{'setup':<10} {'phase':<12} {'tok/s':>7} {'long':>5} {'p50 ms':>8} {'p99 ms':>8} "
          f"{'p99/decode-only':>16}")
    for kind, name, rate, longs, p50, p99, ratio in rows:
        print(f"{kind:<10} {name:<12} {rate:>7.0f} {longs:>5} {p50:>8.1f} {p99:>8.1f} "
              f"{ratio:>16.2f}")


if __name__ == "__main__":
    main()
