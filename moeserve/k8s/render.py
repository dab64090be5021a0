"""`cluster.kind=lws`: a deployment's Kubernetes manifests, rendered and written, never applied
(docs/deploy_k8s.md). Every server is one LeaderWorkerSet group of parallel.nnodes pods; pod k runs
node k (`launch.multinode ... cluster.lws.in_pod=true`, procs/lws.py reads LWS_* there).

- colocated: LWS `<name>` (cluster.lws.replicas servers) and Service `<name>-http` on the leaders'
  HTTP port (not `<name>`: the LWS controller names its headless Service after the LWS).
- pd: LWS `<name>-prefill` and `<name>-decode`, each role's config being the base config plus
  cluster.lws.<role>.overrides; Deployment and Service `<name>-router` run SGLang's router over
  every group's leader by its stable DNS name (a load-balanced Service would split a request's
  prefill and its bootstrap between two prefill servers).
"""

from __future__ import annotations

import os

from moeserve.config import ConfigError, MoeserveConfig, with_overrides
from moeserve.k8s.commands import (
    NODE_COMMAND,
    ROUTER_COMMAND,
    node_args,
    pd_overrides,
    pod_overrides,
    router_args,
)
from moeserve.k8s.objects import (
    LWS_NAME_LABEL,
    LWS_WORKER_INDEX_LABEL,
    Obj,
    PodShape,
    container,
    deployment,
    leader_worker_set,
    metadata,
    pod_template,
    service,
)

APP, INSTANCE, COMPONENT = ("app.kubernetes.io/name", "app.kubernetes.io/instance",
                            "app.kubernetes.io/component")
ROLES = ("prefill", "decode")


def render(cfg: MoeserveConfig, task_overrides: list[str]) -> list[Obj]:
    """The manifests of cfg's deployment; `task_overrides` are the user's Hydra overrides, which
    the pods' commands repeat. A role whose overrides do not make a valid config raises
    ConfigError naming cluster.lws.<role>.overrides."""
    if cfg.cluster.lws.mode == "pd":
        return _pd(cfg, task_overrides)
    return _colocated(cfg, task_overrides)


def write(docs: list[Obj], folder: str, name: str) -> str:
    """Write the manifests as one multi-document YAML file (`kubectl apply -f PATH`); its path."""
    import yaml

    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{name}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump_all(docs, f, sort_keys=False)
    return path


def leader_host(lws_name: str, group: int, namespace: str) -> str:
    """The leader pod of a group under the LWS's headless Service (as LWS_LEADER_ADDRESS)."""
    return f"{lws_name}-{group}.{lws_name}.{namespace}"


def role_config(cfg: MoeserveConfig, role: str) -> MoeserveConfig:
    """The prefill or decode servers' config: the base one plus cluster.lws.<role>.overrides."""
    try:
        return with_overrides(cfg, getattr(cfg.cluster.lws, role).overrides)
    except ConfigError as e:
        raise ConfigError(f"cluster.lws.{role}.overrides", str(e)) from None


def _colocated(cfg: MoeserveConfig, task_overrides: list[str]) -> list[Obj]:
    w = cfg.cluster.lws
    args = node_args(task_overrides, pod_overrides(w))
    lws = _server_set(cfg, w.name, w.replicas, args, "server")
    http = service(metadata(f"{w.name}-http", w.namespace, _labels(w.name, "server")),
                   {LWS_NAME_LABEL: w.name, LWS_WORKER_INDEX_LABEL: "0"},
                   {"http": cfg.server.port})
    return [lws, http]


def _pd(cfg: MoeserveConfig, task_overrides: list[str]) -> list[Obj]:
    w = cfg.cluster.lws
    docs, urls, boot = [], {}, role_config(cfg, "prefill").disaggregation.bootstrap_port
    for role in ROLES:
        rc, spec = role_config(cfg, role), getattr(w, role)
        name = f"{w.name}-{role}"
        args = node_args(task_overrides, [*spec.overrides, *pd_overrides(role),
                                          *pod_overrides(w)])
        extra = {"bootstrap": boot} if role == "prefill" else {}
        docs.append(_server_set(rc, name, spec.replicas, args, role, extra))
        urls[role] = [f"http://{leader_host(name, g, w.namespace)}:{rc.server.port}"
                      for g in range(spec.replicas)]
    name, labels = f"{w.name}-router", _labels(w.name, "router")
    shape = PodShape(image=w.router_image or w.image, env=dict(w.env))
    router = container("router", shape, ROUTER_COMMAND,
                       router_args(urls["prefill"], boot, urls["decode"], w),
                       {"http": w.router_port})
    docs.append(deployment(metadata(name, w.namespace, labels), 1,
                           pod_template(labels, shape, [router])))
    docs.append(service(metadata(name, w.namespace, labels), labels, {"http": w.router_port}))
    return docs


def _server_set(cfg: MoeserveConfig, name: str, replicas: int, args: list[str], component: str,
                extra_ports: dict[str, int] | None = None) -> Obj:
    """One LWS of servers: the leader (node 0) serves HTTP, with a readiness probe on /health."""
    w = cfg.cluster.lws
    labels = _labels(w.name, component)
    shape = _shape(cfg)
    ports = {"http": cfg.server.port, **(extra_ports or {})}
    leader = container("moeserve", shape, NODE_COMMAND, args, ports, ready_path="/health")
    worker = container("moeserve", shape, NODE_COMMAND, args, {})
    return leader_worker_set(metadata(name, w.namespace, labels), replicas, cfg.parallel.nnodes,
                             pod_template(labels, shape, [leader]),
                             pod_template(labels, shape, [worker]))


def _shape(cfg: MoeserveConfig) -> PodShape:
    """A server pod: every GPU of its node (none with device=cpu), cpu/memory when set."""
    w, p = cfg.cluster.lws, cfg.parallel
    resources: dict[str, str | int] = {}
    if cfg.device != "cpu":
        resources[w.gpu_resource] = p.tp_size // p.nnodes
    for key in ("cpu", "memory"):
        if getattr(w, key) is not None:
            resources[key] = getattr(w, key)
    return PodShape(image=w.image, env=dict(w.env), resources=resources, shm_size=w.shm_size,
                    models_pvc=w.models_pvc, models_mount=w.models_mount)


def _labels(instance: str, component: str) -> dict[str, str]:
    return {APP: "moeserve", INSTANCE: instance, COMPONENT: component}
