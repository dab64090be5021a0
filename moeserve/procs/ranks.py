"""A node's share of the deployment: its scheduler ranks (one process each) and, on node 0 with
DP attention, the DP controller. The caller hands in the role functions, so the HTTP server and
the offline Engine start the same processes.

Ranks are numbered node-major: rank = node_rank * ranks_per_node + local_rank.
"""

from __future__ import annotations

from collections.abc import Callable

from moeserve.config import MoeserveConfig
from moeserve.ipc.queues import Endpoints
from moeserve.procs.children import ProcessGroup


def node_ranks(cfg: MoeserveConfig) -> range:
    """The global ranks of this node: rank = node_rank * ranks_per_node + local_rank."""
    p = cfg.parallel
    per_node = p.world_size // p.nnodes
    return range(p.node_rank * per_node, (p.node_rank + 1) * per_node)


def start_ranks(procs: ProcessGroup, cfg: MoeserveConfig, model_path: str, endpoints: Endpoints,
                run_rank: Callable[..., None],
                run_controller: Callable[..., None]) -> set[tuple[str, int]]:
    """Start the DP controller (dp_size > 1, node 0 only: `run_controller(cfg, endpoints)`) and
    one scheduler process per rank of this node (`run_rank(cfg, model_path, endpoints, rank)`);
    returns the (role, rank) pairs whose ReadyMsg to wait for (every node's ranks).
    Call from the main thread."""
    expected = {("scheduler", r) for r in range(cfg.parallel.world_size)}
    if cfg.parallel.dp_size > 1 and cfg.parallel.node_rank == 0:
        procs.start("dp-controller", run_controller, (cfg, endpoints))
        expected.add(("controller", 0))
    for rank in node_ranks(cfg):
        procs.start(f"scheduler-{rank}", run_rank, (cfg, model_path, endpoints, rank))
    return expected
