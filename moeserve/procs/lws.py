"""A pod of a Kubernetes LeaderWorkerSet group as one node of a deployment: its node rank
(LWS_WORKER_INDEX; the leader is 0), the group size (LWS_GROUP_SIZE = parallel.nnodes) and node 0's
address (LWS_LEADER_ADDRESS: rendezvous and ZMQ endpoints). The LWS controller sets these in every
pod; the manifests are rendered by moeserve/k8s/ (docs/deploy_k8s.md)."""

from __future__ import annotations

from moeserve.config import MoeserveConfig
from moeserve.ipc.queues import Endpoints
from moeserve.procs.rendezvous import with_node


def lws_hosts(leader_address: str, size: int) -> list[str]:
    """Each pod's DNS name, node-major: the leader '<lws>-<group>.<svc>.<ns>' first, then worker w
    as '<lws>-<group>-<w>.<svc>.<ns>' (LWS names worker pods after their leader, and every pod of
    the group is under the same headless Service)."""
    pod, dot, domain = leader_address.partition(".")
    return [leader_address] + [f"{pod}-{w}{dot}{domain}" for w in range(1, size)]


def lws_node_config(cfg: MoeserveConfig, env: dict[str, str]) -> tuple[MoeserveConfig, Endpoints]:
    """This pod's node rank and addresses from the LWS environment (one pod per node)."""
    c, p = cfg.cluster, cfg.parallel
    missing = [k for k in ("LWS_LEADER_ADDRESS", "LWS_WORKER_INDEX", "LWS_GROUP_SIZE")
               if k not in env]
    if missing:
        raise RuntimeError(f"cluster.lws.in_pod: {', '.join(missing)} not set (the LeaderWorkerSet "
                           "controller sets them in its pods)")
    size = int(env["LWS_GROUP_SIZE"])
    if size != p.nnodes:
        raise RuntimeError(f"LeaderWorkerSet group has {size} pods, parallel.nnodes is {p.nnodes}")
    hosts = lws_hosts(env["LWS_LEADER_ADDRESS"], size)
    per_node = p.tp_size // p.nnodes
    base = c.zmq_base_port or 29600
    rank_hosts = tuple(hosts[r // per_node] for r in range(p.dp_size))
    endpoints = Endpoints.tcp(hosts[0], base, p.dp_size, rank_hosts)
    addr = p.dist_init_addr or f"{hosts[0]}:{c.dist_port or 29500}"
    return with_node(cfg, int(env["LWS_WORKER_INDEX"]), addr, base), endpoints
