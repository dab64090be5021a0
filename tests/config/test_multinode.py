"""launch.multinode: the Slurm dry run (submitit's sbatch rendering, 2 nodes x 8 GPUs), the Slurm
environment → node rank and addresses, tcp endpoints, and two simulated nodes on this host serving
OpenAI chat end to end (greedy outputs equal the single-process Engine; killing node 1 takes node 0
down with exit 1 and a log line naming it, leaving no process behind)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
from live_server import assert_concurrent_chats_match_engine, role_processes, still_running
from parity import FP32_CPU

import httpx

from moeserve.config import compose
from moeserve.ipc.queues import Endpoints
from moeserve.procs.slurm import expand_nodelist, slurm_node_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---- slurm ---------------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_slurm_dry_run_renders_sbatch_for_2x8(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "launch.multinode", "+cluster=slurm", "+deploy=deepseek_v3_2x8",
         "model.path=/models/DeepSeek-V3", "cluster.partition=h200", "cluster.account=moe",
         "cluster.time_min=120", "cluster.job_name=dsv3-2x8", "cluster.dry_run=true",
         f"hydra.run.dir={tmp_path}"], cwd=REPO, capture_output=True, text=True, timeout=60,
        check=False)
    assert out.returncode == 0, out.stderr
    script = out.stdout.split("# cluster.dry_run:", 1)[1]
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --partition=h200", "#SBATCH --account=moe", "#SBATCH --time=120",
                 "#SBATCH --job-name=dsv3-2x8", f"#SBATCH --output={tmp_path}/submitit/%j_0_log.out"):
        assert line in script, line
    srun = [x for x in script.splitlines() if x.startswith("srun ")]
    assert len(srun) == 1 and "-m submitit.core._submit" in srun[0]
    assert not (tmp_path / "submitit").exists()  # nothing submitted


def test_slurm_nodelist_and_node_config(monkeypatch):
    assert expand_nodelist("gpu[01-03,07],cpu5") == ["gpu01", "gpu02", "gpu03", "gpu07", "cpu5"]
    assert expand_nodelist("h200-a[9-10]") == ["h200-a9", "h200-a10"]
    cfg = compose(["+cluster=slurm", "+deploy=deepseek_v3_2x8", "model.path=/m"])
    monkeypatch.setenv("PATH", "")  # no scontrol: the built-in parser
    env = {"SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "node[07-08]"}
    node, ep = slurm_node_config(cfg, env)
    assert node.parallel.node_rank == 1 and node.parallel.dist_init_addr == "node07:29500"
    assert ep.manager_in == "tcp://node07:29602" and ep.scheduler_in == "tcp://node07:29600"
    assert ep.rank_in[7] == "tcp://node07:29611" and ep.rank_in[8] == "tcp://node08:29612"
    with pytest.raises(RuntimeError, match="3 nodes"):
        slurm_node_config(cfg, {"SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "n[1-3]"})


def test_tcp_endpoints():
    ep = Endpoints.tcp("127.0.0.1", 4000, 2)
    assert ep.scheduler_in == "tcp://127.0.0.1:4000" and ep.controller_in == "tcp://127.0.0.1:4003"
    assert ep.rank_in == ("tcp://127.0.0.1:4004", "tcp://127.0.0.1:4005")
    assert ep.scheduler_address(1) == "tcp://127.0.0.1:4005"
    assert Endpoints.tcp_port_count(2) == 6
    with pytest.raises(ValueError):
        Endpoints.tcp("h", 1, 1)


# ---- local_2node end to end ----------------------------------------------------------------------
QUESTIONS = [f"Node question {i}: {'say more ' * (i % 3 + 1)}" for i in range(6)]
LENS = [3 + 2 * (i % 3) for i in range(6)]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_nodes(tiny_model, tmp_path_factory):
    path = tiny_model("deepseek_v3")
    run_dir = tmp_path_factory.mktemp("local_2node")
    port = free_port()
    log = open(run_dir / "stdout.log", "w+")  # noqa: SIM115 - open for the fixture's lifetime
    cmd = [sys.executable, "-m", "launch.multinode", "+cluster=local_2node",
           f"model.path={path}", "parallel=dp2_ep2", "parallel.nnodes=2", *FP32_CPU,
           f"server.port={port}", f"hydra.run.dir={run_dir}"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"

    def tail() -> str:
        log.flush()
        return (run_dir / "stdout.log").read_text(errors="replace")[-4000:]

    deadline = time.monotonic() + 180
    while True:
        if proc.poll() is not None:
            pytest.fail(f"exited {proc.returncode}:\n{tail()}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"not healthy:\n{tail()}")
        time.sleep(0.5)
    yield proc, url, path, run_dir, tail
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    log.close()


@pytest.mark.timeout(240)
def test_two_nodes_chat_matches_single_process(two_nodes):
    _, url, path, run_dir, _ = two_nodes
    assert_concurrent_chats_match_engine(url, path, QUESTIONS, LENS, FP32_CPU)

    ranks = httpx.get(url + "/server_info", timeout=30).json()["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["prompt_tokens"] > 0 for r in ranks)
    # the resolved config and the logs of both nodes are in the run dir
    assert "kind: local_2node" in (run_dir / ".hydra" / "config.yaml").read_text()
    assert "node_rank: 1" in (run_dir / "node1" / ".hydra" / "config.yaml").read_text()
    assert "scheduler 0 ready" in (run_dir / "moeserve.log").read_text()
    assert "ranks [1] started" in (run_dir / "node1" / "moeserve.log").read_text()


@pytest.mark.timeout(120)
def test_killing_node1_brings_node0_down(two_nodes):
    """Runs last: it ends the shared deployment."""
    psutil = pytest.importorskip("psutil")
    proc, _, _, _, tail = two_nodes
    node0 = psutil.Process(proc.pid)
    everything = node0.children(recursive=True)
    (node1,) = [p for p in everything if "parallel.node_rank=1" in " ".join(p.cmdline())]
    node1_ranks = role_processes(node1.pid)
    assert len(node1_ranks) == 1  # node 1's tree: its one scheduler rank only
    node1.kill()
    assert proc.wait(60) == 1
    assert still_running(everything, timeout=15) == []
    assert re.search(rf"child process 'node-1' \(pid {node1.pid}\) died with exit code -9",
                     tail()), tail()
