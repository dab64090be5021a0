"""A Slurm job as nodes of one deployment: the SlurmExecutor parameters and sbatch script
(one task per node, every GPU of the node to it), and inside a task its node rank and the
addresses of node 0 (first host of SLURM_JOB_NODELIST: rendezvous and ZMQ endpoints)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from typing import Any

from moeserve.config import MoeserveConfig
from moeserve.ipc.queues import Endpoints
from moeserve.procs.rendezvous import with_node


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
