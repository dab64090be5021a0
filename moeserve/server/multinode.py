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
- lws: Kubernetes. Here, the LeaderWorkerSet manifests are written (moeserve/k8s/, nothing is
  applied); in a pod (cluster.lws.in_pod=true, set by those manifests) the pod runs its node,
  node rank and node 0's address from the LWS_* environment.

The addresses and the Slurm and LWS environments are read by procs/rendezvous.py, procs/slurm.py
and procs/lws.py; this module decides what each node runs.
"""

from __future__ import annotations

import logging
import os
import shlex
import sys

from moeserve.config import ConfigError, MoeserveConfig
from moeserve.ipc.queues import Endpoints
from moeserve.k8s.render import render, write
from moeserve.procs.children import ProcessGroup
from moeserve.procs.lws import lws_node_config
from moeserve.procs.rendezvous import free_port_block, free_tcp_port, with_node
from moeserve.procs.slurm import render_sbatch, slurm_node_config, slurm_parameters
from moeserve.server.launch import serve, serve_node

logger = logging.getLogger("moeserve.multinode")

# Overrides the node-0 launcher sets itself on node 1's command line.
_NODE_KEYS = ("parallel.node_rank", "parallel.dist_init_addr", "cluster.zmq_base_port",
              "cluster.dist_port")


def run(cfg: MoeserveConfig, run_dir: str, log_file: str | None, task_overrides: list[str]) -> int:
    kind = cfg.cluster.kind
    if cfg.cluster.dry_run and kind not in ("slurm", "lws"):
        p = cfg.parallel
        print(f"# cluster.dry_run: would start {kind}: {p.nnodes} node(s) x "
              f"{p.tp_size // p.nnodes} rank(s), dp {p.dp_size}, ep {p.ep}; nothing started",
              flush=True)
        return 0
    if kind == "local" and cfg.disaggregation.deployment:
        from moeserve.server.pd_deployment import run_pd_local

        return run_pd_local(cfg, run_dir, task_overrides)
    if kind == "local":
        return serve(cfg, log_file=log_file)
    if kind == "local_2node":
        return run_local_2node(cfg, run_dir, log_file, task_overrides)
    if kind == "slurm":
        return submit_slurm(cfg, run_dir)
    if kind == "lws":
        if cfg.cluster.lws.in_pod:
            return lws_pod_main(cfg, log_file)
        return write_lws(cfg, run_dir, task_overrides)
    raise ValueError(f"unknown cluster.kind {kind!r}")  # validate() refuses it first


# ---- local_2node --------------------------------------------------------------------------------
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


def slurm_node_main(cfg: MoeserveConfig, run_dir: str) -> int:
    """The submitit task on each node."""
    cfg, endpoints = slurm_node_config(cfg, dict(os.environ))
    log_file = os.path.join(run_dir, f"moeserve-node{cfg.parallel.node_rank}.log")
    if cfg.parallel.node_rank == 0:
        return serve(cfg, log_file=log_file, endpoints=endpoints)
    return serve_node(cfg, endpoints, log_file)


# ---- lws ----------------------------------------------------------------------------------------
def write_lws(cfg: MoeserveConfig, run_dir: str, task_overrides: list[str]) -> int:
    """Render and write the manifests (always a dry run); the file's path is the last line."""
    w = cfg.cluster.lws
    try:
        docs = render(cfg, task_overrides)
    except ConfigError as e:
        print(f"moeserve: {e}", file=sys.stderr, flush=True)
        return 2
    path = write(docs, os.path.join(run_dir, w.folder), w.name)
    print(f"# cluster.kind=lws: {len(docs)} manifests written, nothing applied "
          f"(kubectl apply -f {path}):", flush=True)
    for doc in docs:
        print(f"#   {doc['kind']} {doc['metadata']['namespace']}/{doc['metadata']['name']}")
    print(path, flush=True)
    return 0


def lws_pod_main(cfg: MoeserveConfig, log_file: str | None) -> int:
    """A pod of an LWS group: the whole server when the group is one pod, else its node."""
    if cfg.parallel.nnodes == 1:
        return serve(cfg, log_file=log_file)
    cfg, endpoints = lws_node_config(cfg, dict(os.environ))
    if cfg.parallel.node_rank == 0:
        return serve(cfg, log_file=log_file, endpoints=endpoints)
    return serve_node(cfg, endpoints, log_file)
