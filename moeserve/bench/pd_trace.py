"""Where a PD decode core's time goes during a benchmark phase: a per-thread CPU sampler of the
whole host, and the report that joins it with the decode scheduler's step timeline
(MOESERVE_STEP_TIMELINE, scheduler/timeline.py).

    python -m moeserve.bench.pd_trace sample --out F.jsonl --seconds 15 [--interval 0.02]

writes, every interval, each thread's CPU time and run-queue wait since the last sample (from
/proc/<pid>/task/<tid>/schedstat) and the core it last ran on. `report(...)` (pd_itl --trace
calls it) labels the threads (decode scheduler loop, its other threads, the decode server's HTTP
and detokenizer processes, the prefill's, the router, the client, anything else on the host) and
prints, per phase, the decode loop's step gaps and phases, and which labels used the decode core.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import time
from collections import defaultdict

import httpx
import numpy as np


def _threads() -> dict[int, tuple[int, str, int, int, int]]:
    """tid → (pid, comm, core, run ns, wait ns) for every thread on the host."""
    out = {}
    for task in glob.glob("/proc/[0-9]*/task/[0-9]*"):
        try:
            with open(task + "/stat") as f:
                stat = f.read()
            with open(task + "/schedstat") as f:
                run, wait, _ = f.read().split()
        except (OSError, ValueError):
            continue
        comm = stat[stat.index("(") + 1: stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        parts = task.split("/")
        out[int(parts[4])] = (int(parts[2]), comm, int(fields[36]), int(run), int(wait))
    return out


def sample(out_path: str, seconds: float, interval: float) -> None:
    prev, end = _threads(), time.monotonic() + seconds
    with open(out_path, "w") as f:
        while time.monotonic() < end:
            time.sleep(interval)
            now, cur = time.time(), _threads()
            rows = []
            for tid, (pid, comm, core, run, wait) in cur.items():
                p = prev.get(tid)
                d_run, d_wait = (run - p[3], wait - p[4]) if p else (run, wait)
                if d_run or d_wait:
                    rows.append([pid, tid, comm, core, d_run, d_wait])
            f.write(json.dumps({"t": now, "threads": rows}) + "\n")
            prev = cur


def process_labels(root_pid: int, client_pid: int, sched_pids: set[int]) -> dict[int, str]:
    """pid → label for the deployment's process tree (call while it runs); `sched_pids`: the
    scheduler processes (the pids in the timeline files' names)."""
    labels = {client_pid: "client"}
    children: dict[int, list[int]] = defaultdict(list)
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                s = f.read()
        except OSError:
            continue
        children[int(s[s.rindex(")") + 2:].split()[1])].append(int(stat.split("/")[2]))

    def cmdline(pid: int) -> str:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                return f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            return ""

    stack = [root_pid]
    while stack:
        pid = stack.pop()
        stack += children.get(pid, [])
        cmd = cmdline(pid)
        role = next((r for r in ("decode", "prefill") if f"disaggregation={r}" in cmd), None)
        if role is not None and "launch.server" in cmd:
            labels[pid] = f"{role}-http+tokenizer"
            for child in children.get(pid, []):
                labels[child] = (f"{role}-scheduler" if child in sched_pids else
                                 f"{role}-detokenizer" if "spawn_main" in cmdline(child)
                                 else f"{role}-other")
        elif "sglang" in cmd or "router" in cmd:
            labels[pid] = "router"
        elif pid not in labels:
            labels[pid] = "launcher"
    return labels


def timeline_pids(prefix: str) -> set[int]:
    return {int(p.rsplit(".", 2)[-2]) for p in glob.glob(f"{prefix}.rank*.jsonl")}


def _timeline(prefix: str) -> dict[int, list[dict]]:
    out = {}
    for path in glob.glob(f"{prefix}.rank*.jsonl"):
        pid = int(path.rsplit(".", 2)[-2])
        with open(path) as f:
            out[pid] = [json.loads(line) for line in f if line.strip()]
    return out


def decode_url(log_path: str) -> str | None:
    """The decode server's URL, from the PD deployment's start line in its log."""
    with open(log_path) as f:
        m = re.search(r"decode \['([^']+)'", f.read())
    return f"http://{m.group(1)}" if m else None


def itl_buckets(url: str) -> dict[float, float]:
    """The server's ITL histogram (cumulative counts per upper bound), as its tokenizer manager
    measured it: between the outputs it got from the detokenizer, before the router."""
    text = httpx.get(url + "/metrics", timeout=10).text
    out = {}
    for m in re.finditer(r'inter_token_latency_seconds_bucket\{le="([^"]+)"\} ([0-9.e+]+)', text):
        out[float(m.group(1))] = float(m.group(2))
    return out


def save(directory: str, prefix: str, phases: list, labels: dict[int, str]) -> None:
    """What `report` needs, for `python -m moeserve.bench.pd_trace report DIR` later."""
    with open(os.path.join(directory, "trace.json"), "w") as f:
        json.dump({"prefix": prefix, "phases": phases, "labels": labels}, f)


def report(prefix: str, phases: list[tuple[str, float, float, str]], labels: dict[int, str],
           decode_core: int) -> None:
    """phases: (name, start, end, sampler file). Prints the decode loop's step gaps and phases,
    and the decode core's CPU per label (ms per second), overall and during the slowest gaps."""
    lines = next((v for pid, v in _timeline(prefix).items()
                  if labels.get(pid) == "decode-scheduler"), [])
    base_p99 = base_client = None
    for name, t0, t1, sfile, marks, hist in phases:
        steps = [x for x in lines if t0 <= x["t"] < t1 and x["mode"] in ("DECODE",
                                                                           "TARGET_VERIFY")]
        its = [x for x in lines if t0 <= x["t"] < t1]
        ends = np.array([x["t"] + x["dur"] for x in steps])
        gaps = np.diff(ends) * 1e3 if len(ends) > 1 else np.zeros(1)
        p50, p99 = np.percentile(gaps, 50), np.percentile(gaps, 99)
        base_p99 = p99 if base_p99 is None else base_p99
        print(f"\n[{name}] decode loop: {len(steps)} decode steps, step-end gaps ms p50 {p50:.1f} "
              f"p99 {p99:.1f} max {gaps.max():.1f}")
        slow_i = [i for i, g in enumerate(gaps) if g > base_p99] if len(steps) > 1 else []
        slow = [steps[i + 1] for i in slow_i]
        _phase_table("all iterations (ms per decode step)", its, len(steps))
        _phase_table(f"iterations up to each of the {len(slow)} gaps > decode-only p99 "
                     f"{base_p99:.1f} ms (ms per gap)",
                     _preceding(its, slow), max(len(slow), 1))
        windows = [(ends[i], ends[i + 1]) for i in slow_i]
        base_client = _client_table(marks, ends, base_client)
        _server_itl(hist, marks)
        _core_table(sfile, labels, decode_core, t0, t1, windows)


def _client_table(marks: list, ends: np.ndarray, base: float | None) -> float:
    """The client's ITL gaps over the decode-only p99: how long after a long prompt was sent
    each ended, and the longest decode-step gap inside it (is the stall in the decode loop?)."""
    gaps = [(t, g * 1e3) for kind, t, g in (m for m in marks if m[0] == "gap")]
    longs = sorted(m[1] for m in marks if m[0] == "long")
    first = sorted((m[1], m[2]) for m in marks if m[0] == "long")
    p99 = float(np.percentile([g for _, g in gaps], 99)) if gaps else 0.0
    base = p99 if base is None else base
    big = [(t, g) for t, g in gaps if g > base]
    ttft = (f"; long prompts' first chunk {np.median([b - a for a, b in first]) * 1e3:.0f} ms "
            "after sending (median)") if first else ""
    print(f"  client: {len(gaps)} gaps, p99 {p99:.1f} ms; {len(big)} over the decode-only p99 "
          f"{base:.1f} ms{ttft}")
    if big and longs:
        edges = [0, 100, 200, 300, 400, 500, 700, 1000, 1e9]
        since = [1e3 * (t - max(x for x in longs if x <= t)) for t, _ in big if t >= longs[0]]
        hist = np.histogram(since, bins=edges)[0]
        print("    ms since the last long prompt was sent, at the big gaps' ends: " + ", ".join(
            f"{a:g}-{b:g}: {n}" for a, b, n in zip(edges, edges[1:], hist)))
    if big:
        inside = []
        for t, g in big:
            a, b = np.searchsorted(ends, [t - g / 1e3, t])  # one step end past each side
            e = ends[max(a - 1, 0): b + 1]
            inside.append(float(np.diff(e).max() * 1e3) if len(e) > 1 else float("nan"))
        print(f"    longest decode-step gap inside them: median {np.nanmedian(inside):.1f} ms, "
              f"max {np.nanmax(inside):.1f} ms (the big gaps' median: "
              f"{np.median([g for _, g in big]):.1f} ms)")
    return base


def _server_itl(hist: dict | None, marks: list) -> None:
    """Share of ITLs over 50 and 100 ms at the decode server's HTTP process and at the client."""
    if not hist:
        return
    hist = {float(k): v for k, v in hist.items()}  # keys are strings after a JSON round trip
    total = hist.get(float("inf"), 0) or 1
    client = [m[2] for m in marks if m[0] == "gap"] or [0.0]
    server = [100 * (1 - hist.get(b, 0) / total) for b in (0.05, 0.1)]
    ours = [100 * np.mean(np.array(client) > b) for b in (0.05, 0.1)]
    print(f"    ITL > 50 ms / > 100 ms: decode server's tokenizer manager {server[0]:.2f}% / "
          f"{server[1]:.2f}%, client {ours[0]:.2f}% / {ours[1]:.2f}%")


def _preceding(its: list[dict], slow: list[dict]) -> list[dict]:
    """The iterations since the decode step before each slow one (the whole gap)."""
    out, ends = [], {id(x) for x in slow}
    pending: list[dict] = []
    for x in its:
        pending.append(x)
        if x["mode"] in ("DECODE", "TARGET_VERIFY"):
            if id(x) in ends:
                out += pending
            pending = []
    return out


def _phase_table(title: str, its: list[dict], per: int) -> None:
    laps: dict[str, float] = defaultdict(float)
    notes: dict[str, float] = defaultdict(float)
    for x in its:
        for k, v in x["laps"].items():
            laps[k] += v * 1e3
        for k, v in x["notes"].items():
            notes[k] += v
        laps["run-queue wait"] += x["wait_ms"]
        laps["loop cpu"] += x["run_ms"]
    print(f"  {title}: " + ", ".join(f"{k} {v / per:.2f}" for k, v in laps.items()))
    if notes:
        print("    notes: " + ", ".join(f"{k} {v:.0f}" for k, v in notes.items()))


def _core_table(sfile: str, labels: dict[int, str], core: int, t0: float, t1: float,
                windows: list[tuple[float, float]]) -> None:
    """CPU per label on each core, and each label's run-queue wait (runnable, not running)."""
    cpu: dict[tuple[int, str], float] = defaultdict(float)
    wait: dict[str, float] = defaultdict(float)
    slow: dict[str, float] = defaultdict(float)
    slow_span = sum(b - a for a, b in windows)
    with open(sfile) as f:
        for line in f:
            s = json.loads(line)
            if not t0 <= s["t"] < t1:
                continue
            hit = any(a <= s["t"] <= b + 0.02 for a, b in windows)
            for pid, tid, comm, c, run, w in s["threads"]:
                label = labels.get(pid, "other (not this benchmark)")
                if label == "decode-scheduler" and tid != pid:
                    label = f"decode-scheduler thread {comm}"
                cpu[c, label] += run / 1e6
                wait[label] += w / 1e6
                if hit and c == core:
                    slow[label] += run / 1e6
    span = t1 - t0
    cores = sorted({c for c, _ in cpu})
    names = sorted({lb for _, lb in cpu}, key=lambda lb: -sum(cpu[c, lb] for c in cores))
    print(f"  ms per s of the phase: CPU on each core, run-queue wait; decode core {core} CPU per "
          "s of the slow gaps' samples:")
    print(f"    {'':<40} " + " ".join(f"{'core ' + str(c):>8}" for c in cores)
          + f" {'wait':>8} {'slow':>8}")
    for label in names:
        extra = f" {slow[label] / slow_span:8.0f}" if slow_span else ""
        print(f"    {label:<40} " + " ".join(f"{cpu[c, label] / span:8.1f}" for c in cores)
              + f" {wait[label] / span:8.1f}" + extra)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("sample")
    s.add_argument("--out", required=True)
    s.add_argument("--seconds", type=float, required=True)
    s.add_argument("--interval", type=float, default=0.02)
    r = sub.add_parser("report")
    r.add_argument("dir")
    r.add_argument("--decode-core", type=int, default=1)
    args = ap.parse_args()
    if args.cmd == "sample":
        sample(args.out, args.seconds, args.interval)
        return
    with open(os.path.join(args.dir, "trace.json")) as f:
        t = json.load(f)
    report(t["prefix"], t["phases"], {int(k): v for k, v in t["labels"].items()},
           args.decode_core)


if __name__ == "__main__":
    main()
