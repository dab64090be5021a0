"""The PD tests' helpers: SGLang's router over a pair of servers, the one-command deployment, and
the dependency check (Mooncake's transfer engine must load). CI runs as root in a fresh container,
so a missing Debian libibverbs1 is installed here; anything still missing fails the test loudly
(never a skip: a CI without the library would otherwise pass without testing PD)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import httpx
import pytest


def _engine_loads() -> str | None:
    """None when mooncake.engine imports (in a child: a failed import of the .so is cached)."""
    r = subprocess.run([sys.executable, "-c", "import mooncake.engine"], capture_output=True,
                       check=False, text=True, timeout=120)
    return None if r.returncode == 0 else (r.stderr.strip().splitlines() or ["?"])[-1]


def require_mooncake() -> None:
    error = _engine_loads()
    if error is not None and "libibverbs" in error and os.geteuid() == 0:
        subprocess.run(["apt-get", "install", "-y", "-q", "libibverbs1"], capture_output=True,
                       check=False, timeout=600)
        if _engine_loads() is not None:  # a stale package list: refresh it once
            subprocess.run(["apt-get", "update", "-q"], capture_output=True, check=False,
                           timeout=600)
            subprocess.run(["apt-get", "install", "-y", "-q", "libibverbs1"],
                           capture_output=True, check=False, timeout=600)
        error = _engine_loads()
    if error is not None:
        pytest.fail("PD tests need Mooncake's transfer engine (pip: "
                    "mooncake-transfer-engine-non-cuda, in the `test` extra) and Debian's "
                    f"libibverbs1 (apt-get install -y libibverbs1); import failed: {error}")


class Router:
    """sglang-router in PD mode over one prefill and one decode server (`prefill`, `decode`:
    their URLs)."""

    def __init__(self, prefill: str, bootstrap_port: int, decode: str):
        from live_server import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="pd-router-", suffix=".log")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
             "--prefill", prefill, str(bootstrap_port), "--decode", decode,
             "--host", "127.0.0.1", "--port", str(self.port), "--prometheus-port",
             str(free_port())], stdout=self.log, stderr=subprocess.STDOUT)

    def wait(self, timeout: float = 90) -> Router:
        wait_routed(self.url, lambda: self.proc.poll() is None, self.tail, timeout)
        return self

    def tail(self) -> str:
        self.log.seek(0)
        return self.log.read()[-3000:]

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        self.log.close()


def wait_routed(url: str, alive, tail, timeout: float) -> None:
    """Until a /generate through the router at `url` succeeds (it registers workers lazily)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert alive(), tail()
        try:
            r = httpx.post(url + "/generate", timeout=30, json={
                "text": "warm", "sampling_params": {"max_new_tokens": 1}})
            if r.status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    pytest.fail(f"router never served: {tail()}")


class Deployment:
    """`python -m launch.multinode +cluster=local +deploy=pd_tiny_cpu ...`: the one-command PD
    deployment (one prefill, one decode server and the router), its URLs read from its banner."""

    BANNER = re.compile(r"PD deployment: router on (\S+), prefill \['([^']+)'\], "
                        r"decode \['([^']+)'\]")

    def __init__(self, overrides: list[str]):
        from live_server import REPO, free_port

        self.router_port = free_port()
        self.run_dir = tempfile.mkdtemp(prefix="moeserve-pd-run-")
        self.log = tempfile.NamedTemporaryFile("w+", prefix="pd-deploy-", suffix=".log")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "launch.multinode", "+cluster=local", "+deploy=pd_tiny_cpu",
             f"disaggregation.router_port={self.router_port}", f"hydra.run.dir={self.run_dir}",
             *overrides], cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT)
        self.url = self.prefill = self.decode = ""

    def tail(self) -> str:
        with open(self.log.name, errors="replace") as f:
            return f.read()[-4000:]

    def wait(self, timeout: float = 300) -> Deployment:
        deadline = time.monotonic() + timeout
        while not self.url and time.monotonic() < deadline:
            assert self.proc.poll() is None, self.tail()
            with open(self.log.name, errors="replace") as f:
                m = self.BANNER.search(f.read())
            if m:
                self.url = m.group(1)
                self.prefill, self.decode = (f"http://{m.group(k)}" for k in (2, 3))
            time.sleep(0.3)
        wait_routed(self.url, lambda: self.proc.poll() is None, self.tail,
                    deadline - time.monotonic())
        return self

    def stop(self, timeout: float = 60) -> int | None:
        """SIGTERM, as a user's Ctrl-C or `kill` would: → its exit code (None: it hung and was
        killed)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                return None
        return self.proc.returncode
