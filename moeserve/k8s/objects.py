"""Kubernetes objects as plain dicts, the shapes `kubectl apply` reads: a container, a pod template,
a LeaderWorkerSet (leaderworkerset.x-k8s.io/v1), a Deployment and a Service. This module knows
Kubernetes, not moeserve's config; render.py decides what goes in them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

LWS_API = "leaderworkerset.x-k8s.io/v1"
# Labels the LWS controller puts on every pod of a group (the leader has worker-index "0").
LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
_SHM, _MODELS = "dshm", "models"

Obj = dict[str, Any]


@dataclass(frozen=True)
class PodShape:
    """What every container of a deployment shares: image, environment, resources, volumes."""

    image: str
    env: dict[str, str] = field(default_factory=dict)
    resources: dict[str, str | int] = field(default_factory=dict)  # requests = limits
    shm_size: str | None = None  # a memory-backed emptyDir at /dev/shm
    models_pvc: str | None = None  # a PersistentVolumeClaim mounted read-only at models_mount
    models_mount: str = "/models"


def metadata(name: str, namespace: str, labels: dict[str, str]) -> Obj:
    return {"name": name, "namespace": namespace, "labels": dict(labels)}


def container(name: str, shape: PodShape, command: list[str], args: list[str],
              ports: dict[str, int], ready_path: str | None = None) -> Obj:
    """One container; `ready_path`: an HTTP readiness probe on the first port (no liveness probe:
    loading a large checkpoint must not get the pod killed)."""
    c: Obj = {"name": name, "image": shape.image, "command": list(command), "args": list(args)}
    if shape.env:
        c["env"] = [{"name": k, "value": str(v)} for k, v in shape.env.items()]
    if ports:
        c["ports"] = [{"name": k, "containerPort": v, "protocol": "TCP"} for k, v in ports.items()]
    if shape.resources:
        amounts = {k: str(v) for k, v in shape.resources.items()}
        c["resources"] = {"limits": amounts, "requests": dict(amounts)}
    mounts = []
    if shape.shm_size:
        mounts.append({"name": _SHM, "mountPath": "/dev/shm"})
    if shape.models_pvc:
        mounts.append({"name": _MODELS, "mountPath": shape.models_mount, "readOnly": True})
    if mounts:
        c["volumeMounts"] = mounts
    if ready_path and ports:
        c["readinessProbe"] = {"httpGet": {"path": ready_path, "port": next(iter(ports))},
                               "periodSeconds": 10, "failureThreshold": 3}
    return c


def pod_template(labels: dict[str, str], shape: PodShape, containers: list[Obj]) -> Obj:
    """A PodTemplateSpec with the shape's volumes."""
    volumes = []
    if shape.shm_size:
        volumes.append({"name": _SHM, "emptyDir": {"medium": "Memory",
                                                   "sizeLimit": shape.shm_size}})
    if shape.models_pvc:
        volumes.append({"name": _MODELS, "persistentVolumeClaim": {
            "claimName": shape.models_pvc, "readOnly": True}})
    spec: Obj = {"containers": containers}
    if volumes:
        spec["volumes"] = volumes
    return {"metadata": {"labels": dict(labels)}, "spec": spec}


def leader_worker_set(meta: Obj, replicas: int, size: int, leader: Obj, worker: Obj) -> Obj:
    """`replicas` groups of `size` pods (a leader and size - 1 workers). Workers start with the
    leader, not after it is ready (our leader is ready only once every node has joined), and a
    pod's restart recreates its whole group (a node alone cannot rejoin a running deployment)."""
    return {"apiVersion": LWS_API, "kind": "LeaderWorkerSet", "metadata": meta,
            "spec": {"replicas": replicas, "startupPolicy": "LeaderCreated",
                     "leaderWorkerTemplate": {
                         "size": size, "restartPolicy": "RecreateGroupOnPodRestart",
                         "leaderTemplate": leader, "workerTemplate": worker}}}


def deployment(meta: Obj, replicas: int, template: Obj) -> Obj:
    selector = dict(template["metadata"]["labels"])
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta,
            "spec": {"replicas": replicas, "selector": {"matchLabels": selector},
                     "template": template}}


def service(meta: Obj, selector: dict[str, str], ports: dict[str, int]) -> Obj:
    """A ClusterIP Service; each port forwards to the container port of the same name."""
    return {"apiVersion": "v1", "kind": "Service", "metadata": meta,
            "spec": {"type": "ClusterIP", "selector": dict(selector),
                     "ports": [{"name": k, "port": v, "targetPort": k, "protocol": "TCP"}
                               for k, v in ports.items()]}}
