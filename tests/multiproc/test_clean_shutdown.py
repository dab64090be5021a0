"""A clean shutdown of dp2 x ep2 prints nothing from C++ and leaves nothing behind, on CPU (gloo):
the offline Engine (a2a and p2p dispatchers, one after the other in one process, as
scripts/gpu_dp_check.py runs them on GPUs) and the HTTP server stopped by SIGTERM. Every rank
must also have taken the ordered teardown of scheduler/shutdown.py (its log line), not been cut
short by the stop watcher or SIGKILLed; the 2-GPU counterpart is `scripts/gpu_dp_check.py`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
from live_server import REPO, LiveServer

import httpx

from moeserve.scheduler.shutdown import TEARDOWN_LINE, UNCLEAN_EXIT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

DP2_EP2 = ["device=cpu", "model.dtype=float32", "parallel.tp_size=2", "parallel.dp_size=2"]

ENGINE_SCRIPT = textwrap.dedent("""
    import sys
    from moeserve import Engine

    def main(path, overrides):
        for backend in ("a2a", "p2p"):
            eng = Engine(path, overrides + [f"parallel.a2a_backend={backend}"])
            outs = eng.generate(input_ids=[[11, 12, 13, 14], [21, 22, 23]],
                                sampling_params={"temperature": 0, "ignore_eos": True,
                                                 "max_new_tokens": 6})
            procs = eng._core._children.procs.children
            eng.shutdown()
            print(backend, [len(o["output_ids"]) for o in outs],
                  [(c.name, c.process.exitcode) for c in procs], flush=True)

    if __name__ == "__main__":
        main(sys.argv[1], sys.argv[2:])
""")


def assert_clean(log: str, teardowns: int) -> None:
    bad = [line for line in log.splitlines() if UNCLEAN_EXIT.search(line)]
    assert not bad, "\n".join(bad[:20])
    ranks = sorted(int(r) for r in TEARDOWN_LINE.findall(log))
    assert ranks == sorted([0, 1] * teardowns), log[-3000:]


@pytest.fixture(scope="module")
def tiny_v3(tiny_model):
    return tiny_model("deepseek_v3")


def test_engine_dp2_ep2_shutdown_is_clean(tiny_v3, tmp_path):
    script = tmp_path / "engine_dp2.py"
    script.write_text(ENGINE_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(script), tiny_v3, *DP2_EP2], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert [ln.split()[0] for ln in lines] == ["a2a", "p2p"], proc.stdout
    for ln in lines:  # every child exited by itself with 0
        assert "[6, 6]" in ln and "-9" not in ln and ", 1)" not in ln, ln
    assert_clean(proc.stderr, teardowns=2)


def test_server_dp2_ep2_sigterm_is_clean(tiny_v3):
    server = LiveServer([f"model.path={tiny_v3}", *DP2_EP2, "parallel.a2a_backend=a2a",
                         "server.served_model_name=m"], env={"OMP_NUM_THREADS": "1"})
    try:
        server.wait_healthy()
        body = {"model": "m", "prompt": "hello", "max_tokens": 4, "temperature": 0,
                "ignore_eos": True}
        reply = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(60) == 0
        log = server.log_tail(500_000)
    finally:
        server.stop()
    assert "all child processes stopped" in log
    assert_clean(log, teardowns=1)
