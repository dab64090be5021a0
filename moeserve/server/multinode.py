"""Several nodes: `launch.multinode +cluster=NAME` dispatches here.

- local: one node, the same as `launch.server`.
- local_2node: two simulated nodes on this host. Node 0 (this process) serves HTTP and runs the
  tokenizer manager, DP controller, detokenizer and its ranks; node 1 is a separate process tree
  (`python -m launch.multinode ... parallel.node_rank=1`) that runs only its ranks. ZMQ is tcp://
  (Endpoints.tcp) and torch.distributed meets at node_addr:port. Node 0 starts node 1 as one of
  its supervised children (exec'd in place of a spawn child, so it dies with node 0 and its death
  takes node 0 down with a log line naming 'node-1').
- slurm: submitit, one task per node; each task reads SLURM_NODEID and SLURM_JOB_NODELIST (first
  host = node 0: rendezvous and ZMQ endpoints) and runs node-local ranks. dry_run prints the sbatch
  script submitit would submit.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import re
import shlex
import socket
import subprocess
import sys
from typing import Any

from moeserve.config import MoeserveConfig
from moeserve.ipc.queues import Endpoints
from moeserve.server.children import ProcessGroup
from moeserve.server.launch import free_tcp_port, serve, serve_node

logger = logging.getLogger("moeserve.multinode")

# Overrides the node-0 launcher sets itself on node 1's command line.
_NODE_KEYS = ("parallel.node_rank", "parallel.dist_init_addr", "cluster.zmq_base_port",
              "cluster.dist_port")


def run(cfg: MoeserveConfig, run_dir: str, log_file: str | None, task_overrides: list[str]) -> int:
    kind = cfg.cluster.kind
    if cfg.cluster.dry_run and kind != "slurm":
        p = cfg.parallel
        print(f"# cluster.dry_run: would start {kind}: {p.nnodes} node(s) x "
              f"{p.tp_size // p.nnodes} rank(s), dp {p.dp_size}, ep {p.ep}; nothing started",
              flush=True)
        return 0
    if kind == "local":
        return serve(cfg, log_file=log_file)
    if kind == "local_2node":
        return run_local_2node(cfg, run_dir, log_file, task_overrides)
    if kind == "slurm":
        return submit_slurm(cfg, run_dir)
    raise ValueError(f"unknown cluster.kind {kind!r}")  # validate() refuses it first


# ---- local_2node --------------------------------------------------------------------------------
def free_port_block(host: str, count: int, attempts: int = 50) -> int:
    """A base port with `count` consecutive free ports on host."""
    for _ in range(attempts):
        base = random.randrange(20000, 60000 - count)
        socks = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                socks.append(s)
                s.bind((host, port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {count} consecutive free ports on {host}")


def with_node(cfg: MoeserveConfig, node_rank: int, dist_init_addr: str,
              zmq_base_port: int) -> MoeserveConfig:
    return dataclasses.replace(
        cfg, parallel=dataclasses.replace(cfg.parallel, node_rank=node_rank,
                                          dist_init_addr=dist_init_addr),
        cluster=dataclasses.replace(cfg.cluster, zmq_base_port=zmq_base_port))


def run_local_2node(cfg: MoeserveConfig, run_dir: str, log_file: str | None,
                    task_overrides: list[str]) -> int:
    c, p = cfg.cluster, cfg.parallel
    if p.node_rank > 0:  # started by node 0 below, with the addresses it chose
        if p.dist_init_addr is None or c.zmq_base_port is None:
            raise SystemExit("local_2node node_rank > 0 needs parallel.dist_init_addr and "
                             "cluster.zmq_base_port (node 0 sets them)")
        return serve_node(cfg, Endpoints.tcp(c.node_addr, c.zmq_base_port, p.dp_size), log_file)
    addr = p.dist_init_addr or f"{c.node_addr}:{c.dist_port or free_tcp_port(c.node_addr)}"
    base = c.zmq_base_port or free_port_block(c.node_addr, Endpoints.tcp_port_count(p.dp_size))
    cfg = with_node(cfg, 0, addr, base)
    endpoints = Endpoints.tcp(c.node_addr, base, p.dp_size)
    kept = [o for o in task_overrides if o.split("=", 1)[0].lstrip("+~") not in _NODE_KEYS]
    argv = [sys.executable, "-m", "launch.multinode", *kept, "parallel.node_rank=1",
            f"parallel.dist_init_addr={addr}", f"cluster.zmq_base_port={base}",
            f"hydra.run.dir={os.path.join(run_dir, 'node1')}"]
    logger.info("local_2node: node 0 here, node 1 as: %s", shlex.join(argv))

    def start_node1(procs: ProcessGroup) -> None:
        procs.start("node-1", exec_argv, (argv,))

    return serve(cfg, log_file=log_file, endpoints=endpoints, start_first=start_node1)


def exec_argv(argv: list[str]) -> None:
    """Child target: become `argv` (same pid, so the parent supervises it as a child; the
    die-with-parent signal set by child_entry survives exec)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(argv[0], argv)


# ---- slurm --------------------------------------------------------------------------------------
def slurm_parameters(cfg: MoeserveConfig) -> dict[str, Any]:
    """SlurmExecutor parameters: one task per node, every GPU of the node to that task."""
    c, p = cfg.cluster, cfg.parallel
    params: dict[str, Any] = {
        "nodes": p.nnodes, "ntasks_per_node": 1, "gpus_per_node": p.tp_size // p.nnodes,
        "time": c.time_min, "job_name": c.job_name, "partition": c.partition,
        "account": c.account, "cpus_per_task": c.cpus_per_task, "setup": list(c.setup) or None}
    return {k: v for k, v in params.items() if v is not None}


def render_sbatch(cfg: MoeserveConfig, folder: str) -> str:
    """The sbatch script submitit's SlurmExecutor would submit (its own renderer and command)."""
    from submitit.slurm.slurm import _make_sbatch_string

    command = " ".join([shlex.quote(sys.executable), "-u -m submitit.core._submit",
                        shlex.quote(folder)])
    return _make_sbatch_string(command=command, folder=folder, **slurm_parameters(cfg))


def submit_slurm(cfg: MoeserveConfig, run_dir: str) -> int:
    folder = os.path.join(run_dir, cfg.cluster.folder)
    if cfg.cluster.dry_run:
        print("# cluster.dry_run: the sbatch script that would be submitted (nothing submitted)")
        print(render_sbatch(cfg, folder), flush=True)
        return 0
    import submitit

    executor = submitit.SlurmExecutor(folder=folder)
    executor.update_parameters(**slurm_parameters(cfg))
    job = executor.submit(slurm_node_main, cfg, run_dir)
    print(f"submitted Slurm job {job.job_id} ({cfg.parallel.nnodes} nodes); logs in {folder}",
          flush=True)
    return 0


def expand_nodelist(nodelist: str) -> list[str]:
    """Slurm's compact host list ('gpu[01-03,07],cpu5') → hosts, without scontrol."""
    hosts: list[str] = []
    for m in re.finditer(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist):
        prefix, ranges = m.group(1), m.group(2)
        if ranges is None:
            hosts.append(prefix)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            for i in range(int(lo), int(hi or lo) + 1):
                hosts.append(f"{prefix}{i:0{len(lo)}d}")
    return hosts


def slurm_hosts(env: dict[str, str]) -> list[str]:
    nodelist = env["SLURM_JOB_NODELIST"]
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                             text=True, check=True, timeout=30).stdout.split()
        if out:
            return out
    except (OSError, subprocess.SubprocessError):
        pass
    return expand_nodelist(nodelist)


def slurm_node_config(cfg: MoeserveConfig, env: dict[str, str]) -> tuple[MoeserveConfig, Endpoints]:
    """This task's node rank and addresses from the Slurm environment (one task per node)."""
    c, p = cfg.cluster, cfg.parallel
    node_rank = int(env.get("SLURM_NODEID", env.get("SLURM_PROCID", "0")))
    hosts = slurm_hosts(env)
    if len(hosts) != p.nnodes:
        raise RuntimeError(f"Slurm gave {len(hosts)} nodes, parallel.nnodes is {p.nnodes}")
    per_node = p.tp_size // p.nnodes
    base = c.zmq_base_port or 29600
    rank_hosts = tuple(hosts[r // per_node] for r in range(p.dp_size))
    endpoints = Endpoints.tcp(hosts[0], base, p.dp_size, rank_hosts)
    addr = p.dist_init_addr or f"{hosts[0]}:{c.dist_port or 29500}"
    return with_node(cfg, node_rank, addr, base), endpoints


def slurm_node_main(cfg: MoeserveConfig, run_dir: str) -> int:
    """The submitit task on each node."""
    cfg, endpoints = slurm_node_config(cfg, dict(os.environ))
    log_file = os.path.join(run_dir, f"moeserve-node{cfg.parallel.node_rank}.log")
    if cfg.parallel.node_rank == 0:
        return serve(cfg, log_file=log_file, endpoints=endpoints)
    return serve_node(cfg, endpoints, log_file)
