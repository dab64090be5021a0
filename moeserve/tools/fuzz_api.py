"""Fuzz a live server's HTTP API from its OpenAPI document (schemathesis, valid and invalid
requests for every route), bounded in examples and time; every response must be a 2xx, or a 4xx
in OpenAI's error format — never a 5xx, a hang (per-request timeout) or a dead server.
`schemathesis_cli` runs schemathesis' own `run --checks all` (the document is the contract: valid
requests served, invalid ones refused, statuses, bodies and content types as documented).

    python -m moeserve.tools.fuzz_api --url http://127.0.0.1:30000 --examples 5000 --minutes 30

Needs `schemathesis` (the test extra). Then checks that the server is back to its baseline:
/health 200, no request in flight, every rank's memory clean (no running or waiting request,
nothing locked in the radix cache, every KV slot and request row free or cache-owned) and, after
/flush_cache, no KV slot in use. `scripts/fuzz.sh` starts a server and runs the long version.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class FuzzReport:
    requests: int = 0
    statuses: Counter = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)  # 5xx, bad error bodies, timeouts
    slowest_s: float = 0.0
    slowest: str = ""
    baseline: list[str] = field(default_factory=list)  # what is not back to baseline after

    @property
    def server_errors(self) -> int:
        return sum(n for status, n in self.statuses.items() if status >= 500)

    def summary(self) -> str:
        return (f"{self.requests} requests, statuses {dict(sorted(self.statuses.items()))}, "
                f"5xx {self.server_errors}, problems {len(self.problems)}, slowest "
                f"{self.slowest_s:.2f} s ({self.slowest}), baseline "
                f"{'ok' if not self.baseline else self.baseline}")


def openai_error_problem(status: int, body: bytes) -> str | None:
    """Why a response breaks the contract (None: it keeps it)."""
    if status >= 500:
        return f"server error {status}"
    if status < 400:
        return None if status < 300 else f"unexpected status {status}"
    try:
        error = json.loads(body)["error"]
        ok = (isinstance(error, dict) and isinstance(error.get("message"), str)
              and isinstance(error.get("type"), str) and {"param", "code"} <= error.keys())
    except (ValueError, KeyError, TypeError):
        ok = False
    return None if ok else f"{status} not in OpenAI's error format"


def fuzz(url: str, max_examples: int = 300, time_limit_s: float = 240.0,
         request_timeout_s: float = 60.0, headers: dict[str, str] | None = None,
         seed: int = 0) -> FuzzReport:
    """About `max_examples` requests spread over every operation of the OpenAPI document, half
    valid and half invalid (schemathesis' positive and negative modes), within `time_limit_s`."""
    import schemathesis

    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    ops = [result.ok() for result in schema.get_all_operations()]
    modes = list(schemathesis.GenerationMode)
    per_run = max(1, max_examples // (len(ops) * len(modes)))
    report, deadline = FuzzReport(), time.monotonic() + time_limit_s
    rounds = 0
    while report.requests < max_examples and time.monotonic() < deadline:
        before = report.requests
        for op in ops:  # rounds with new seeds until the budget is spent: operations without
            for mode in modes:  # inputs give one example per round, others up to per_run
                _fuzz_operation(op, mode, per_run, seed + rounds, deadline, max_examples, url,
                                request_timeout_s, headers, report)
        rounds += 1
        if report.requests == before:
            break
    report.baseline = check_baseline(url, headers)
    return report


def _fuzz_operation(op: Any, mode: Any, examples: int, seed: int, deadline: float, limit: int,
                    url: str, timeout: float, headers: dict[str, str] | None,
                    report: FuzzReport) -> None:
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hyp_seed
    from hypothesis.errors import Unsatisfiable

    @hyp_seed(seed)
    @settings(max_examples=examples, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck), report_multiple_bugs=False)
    @given(op.as_strategy(generation_mode=mode))
    def run(case: Any) -> None:
        if time.monotonic() < deadline and report.requests < limit:
            _call(case, url, timeout, headers, report)

    try:
        run()
    except Unsatisfiable:  # e.g. no invalid request exists for a GET without inputs
        pass


def _call(case: Any, url: str, timeout: float, headers: dict[str, str] | None,
          report: FuzzReport) -> None:
    what = f"{case.method} {case.formatted_path}"
    t0 = time.monotonic()
    try:
        response = case.call(base_url=url, timeout=timeout, headers=headers)
    except Exception as e:  # timeouts, dropped connections: the server broke its contract
        report.requests += 1
        report.problems.append(f"{what}: {type(e).__name__}: {e}")
        return
    took = time.monotonic() - t0
    report.requests += 1
    report.statuses[response.status_code] += 1
    if took > report.slowest_s:
        report.slowest_s, report.slowest = took, what
    problem = openai_error_problem(response.status_code, response.content)
    if problem is not None:
        body = response.content[:300].decode(errors="replace")
        report.problems.append(f"{what}: {problem}: {body} (request: {_body_of(case)})")


def _body_of(case: Any) -> str:
    try:
        return json.dumps(case.body)[:300]
    except (TypeError, ValueError):
        return repr(case.body)[:300]


@dataclass
class CliRun:
    returncode: int
    output: str

    @property
    def summary(self) -> str:
        """The run's last lines: cases generated and passed, failures, time."""
        tail = [line.strip() for line in self.output.splitlines() if line.strip()]
        keep = [line for line in tail if any(w in line for w in (
            "generated", "failures", "No issues", "Failures", "ST1", "ST2", "ST3"))]
        return "; ".join(keep[-8:])


def schemathesis_cli(url: str, seconds: float, seed: int = 0, max_examples: int = 30,
                     headers: dict[str, str] | None = None, timeout_s: float = 30.0) -> CliRun:
    """`schemathesis run URL/openapi.json --checks all` (every phase, every check, including the
    10 s response time limit) for about `seconds`, deterministic for a seed; returncode 0 means no
    failure and no error."""
    cmd = [sys.executable, "-c", "import sys; from schemathesis.cli import schemathesis; "
           "sys.exit(schemathesis())", "run", url + "/openapi.json", "--checks", "all",
           "-n", str(max_examples), "--seed", str(seed), "--max-time", str(int(seconds)),
           "--request-timeout", str(timeout_s), "--generation-database", "none"]
    for name, value in (headers or {}).items():
        cmd += ["-H", f"{name}: {value}"]
    with tempfile.TemporaryDirectory() as cwd:  # the CLI keeps its state in ./.schemathesis
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 300,
                              env={**os.environ, "NO_COLOR": "1"}, cwd=cwd)
    return CliRun(done.returncode, done.stdout + done.stderr)


def check_baseline(url: str, headers: dict[str, str] | None = None,
                   settle_s: float = 30.0) -> list[str]:
    """What is not back to baseline once the traffic stopped (waits up to `settle_s` for
    aborted requests to drain); empty when everything is."""
    client = httpx.Client(base_url=url, headers=headers, timeout=30)
    deadline, problems = time.monotonic() + settle_s, ["not checked"]
    while problems and time.monotonic() < deadline:
        problems = []
        health = client.get("/health")
        if health.status_code != 200:
            problems.append(f"/health {health.status_code}")
        info = client.get("/server_info").json()
        if info["inflight"]:
            problems.append(f"{info['inflight']} request(s) in the manager's table")
        for rank in info["ranks"]:
            if rank.get("running") or rank.get("waiting") or not rank.get("memory_clean", True):
                problems.append(f"rank {rank['rank']}: running {rank.get('running')}, waiting "
                                f"{rank.get('waiting')}, memory clean {rank.get('memory_clean')}")
        if not problems:
            if client.post("/flush_cache").status_code != 200:
                problems.append("/flush_cache refused")
            used = [r["used_tokens"] for r in client.get("/server_info").json()["ranks"]]
            if any(used):
                problems.append(f"KV slots still used after a flush: {used}")
        if problems:
            time.sleep(0.5)
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:30000")
    ap.add_argument("--examples", type=int, default=5000)
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    report = fuzz(args.url, args.examples, args.minutes * 60, headers=headers, seed=args.seed)
    for problem in report.problems[:50]:
        print("PROBLEM", problem)
    print(report.summary())
    return 1 if report.problems or report.baseline else 0


if __name__ == "__main__":
    sys.exit(main())
