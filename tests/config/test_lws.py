"""cluster=lws: `launch.multinode` writes Kubernetes LeaderWorkerSet manifests (a dry run), parsed
here by the official `kubernetes` client's models (a field it does not know, or of the wrong type,
does not survive its deserialize → serialize round trip) and the router's command by
sglang-router's own argument parser. The pods' Hydra overrides are composed again here and given an
LWS environment, so the ranks each pod would run are checked, not just the strings. No server
starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml
from kubernetes.client import ApiClient
from kubernetes.utils import parse_quantity

from moeserve.config import ConfigError, compose
from moeserve.k8s.render import render
from moeserve.procs.lws import lws_node_config
from moeserve.procs.ranks import node_ranks
from moeserve.server.multinode import lws_pod_main

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE = ["+cluster=lws", "+deploy=deepseek_v3_2x8", "model.path=/models/DSV3",
        "cluster.lws.image=registry.example/moeserve:1"]
PREFILL_1x8 = ('cluster.lws.prefill.overrides=["parallel.nnodes=1","parallel.tp_size=8",'
               '"parallel.dp_size=8","parallel.ep_size=8"]')
API = ApiClient()


def render_cli(tmp_path, *overrides: str) -> list[dict]:
    """Run the launcher; the manifests file is the last line it prints."""
    out = subprocess.run([sys.executable, "-m", "launch.multinode", *BASE, *overrides,
                          f"hydra.run.dir={tmp_path}"], cwd=REPO, capture_output=True,
                         text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    path = out.stdout.strip().splitlines()[-1]
    assert path == str(tmp_path / "lws" / "moeserve.yaml")
    with open(path) as f:
        return list(yaml.safe_load_all(f))


def k8s(obj: dict, kind: str):
    """The client's model of `obj`; every field we wrote must come back unchanged."""
    model = API.deserialize(json.dumps(obj), kind, "application/json")
    assert API.sanitize_for_serialization(model) == obj, f"{kind} lost or changed fields"
    return model


def templates(lws: dict):
    """(leader, worker) as V1PodTemplateSpec, after checking the LWS's own fields."""
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1" and lws["kind"] == "LeaderWorkerSet"
    k8s(lws["metadata"], "V1ObjectMeta")
    assert set(lws["spec"]) == {"replicas", "startupPolicy", "leaderWorkerTemplate"}
    assert lws["spec"]["startupPolicy"] == "LeaderCreated"  # our leader is ready last
    t = lws["spec"]["leaderWorkerTemplate"]
    assert set(t) == {"size", "restartPolicy", "leaderTemplate", "workerTemplate"}
    assert t["restartPolicy"] == "RecreateGroupOnPodRestart"
    return k8s(t["leaderTemplate"], "V1PodTemplateSpec"), k8s(t["workerTemplate"],
                                                             "V1PodTemplateSpec")


def pod_config(args: list[str], drop: tuple[str, ...] = ("hydra.",)):
    """The config a pod composes from its container args (less its run dir)."""
    return compose([a for a in args if not a.lstrip("+~").startswith(drop)])


# ---- colocated: one dp16 x ep16 server over 2 pods of 8 GPUs, 2 replicas -----------------------
@pytest.fixture(scope="module")
def colocated(tmp_path_factory):
    return render_cli(tmp_path_factory.mktemp("lws"), "cluster.lws.replicas=2",
                      "cluster.lws.memory=512Gi", "cluster.lws.cpu=64",
                      "cluster.lws.models_pvc=models", "+cluster.lws.env.NCCL_DEBUG=INFO")


def test_colocated_pods(colocated):
    lws, svc = colocated
    assert lws["spec"]["replicas"] == 2 and lws["spec"]["leaderWorkerTemplate"]["size"] == 2
    leader, worker = templates(lws)
    for pod in (leader, worker):
        (c,) = pod.spec.containers
        assert c.image == "registry.example/moeserve:1"
        assert c.command == ["python", "-m", "launch.multinode"]
        assert c.args[:3] == BASE[:3]  # the user's overrides, less the render-only ones
        assert not [a for a in c.args if a.startswith(("cluster.lws.image", "+cluster.lws.env"))]
        assert {"cluster.lws.in_pod=true", "server.host=0.0.0.0"} <= set(c.args)
        assert c.resources.limits == c.resources.requests == {
            "nvidia.com/gpu": "8", "memory": "512Gi", "cpu": "64"}
        assert parse_quantity(c.resources.limits["memory"]) == 512 * 2**30
        assert [(e.name, e.value) for e in c.env] == [("NCCL_DEBUG", "INFO")]
        mounts = {m.mount_path: m.name for m in c.volume_mounts}
        volumes = {v.name: v for v in pod.spec.volumes}
        shm = volumes[mounts["/dev/shm"]].empty_dir
        assert shm.medium == "Memory" and parse_quantity(shm.size_limit) == 16 * 2**30
        assert volumes[mounts["/models"]].persistent_volume_claim.claim_name == "models"
    (lc,), (wc,) = leader.spec.containers, worker.spec.containers
    assert [(p.name, p.container_port) for p in lc.ports] == [("http", 30000)]
    probe = lc.readiness_probe.http_get
    assert (probe.path, probe.port) == ("/health", "http")
    assert wc.ports is None and wc.readiness_probe is None
    assert lc.args == wc.args  # the node rank comes from LWS_WORKER_INDEX, not the command

    s = k8s(svc, "V1Service")
    assert s.metadata.name == "moeserve-http"  # the LWS's headless Service is 'moeserve'
    assert s.spec.selector == {"leaderworkerset.sigs.k8s.io/name": "moeserve",
                               "leaderworkerset.sigs.k8s.io/worker-index": "0"}
    assert [(p.port, p.target_port) for p in s.spec.ports] == [(30000, "http")]


def test_colocated_pods_run_their_ranks(colocated):
    """Each pod's own command, with the environment LWS gives pod w of group 0 (leader address as
    in LWS's docs: <lws>-<group>.<lws>.<namespace>), runs ranks 8w..8w+7 of one 16-rank server."""
    args = templates(colocated[0])[0].spec.containers[0].args
    cfg = pod_config(args)
    assert cfg.cluster.kind == "lws" and cfg.cluster.lws.in_pod and cfg.server.host == "0.0.0.0"
    assert cfg.cluster.lws.image is None  # a pod needs no render-only key
    for w in (0, 1):
        env = {"LWS_LEADER_ADDRESS": "moeserve-0.moeserve.default", "LWS_WORKER_INDEX": str(w),
               "LWS_GROUP_SIZE": "2"}
        node, ep = lws_node_config(cfg, env)
        assert node.parallel.node_rank == w
        assert list(node_ranks(node)) == list(range(8 * w, 8 * w + 8))
        assert node.parallel.dist_init_addr == "moeserve-0.moeserve.default:29500"
        assert ep.scheduler_in == "tcp://moeserve-0.moeserve.default:29600"
        assert ep.rank_in[7] == "tcp://moeserve-0.moeserve.default:29611"
        assert ep.rank_in[8] == "tcp://moeserve-0-1.moeserve.default:29612"  # worker pod 1
    with pytest.raises(RuntimeError, match="3 pods"):
        lws_node_config(cfg, {**env, "LWS_GROUP_SIZE": "3"})
    with pytest.raises(RuntimeError, match="LWS_WORKER_INDEX"):
        lws_node_config(cfg, {"LWS_LEADER_ADDRESS": "a", "LWS_GROUP_SIZE": "2"})


def test_pod_outside_lws_says_what_is_missing(colocated, monkeypatch):
    """A pod command run where no LWS controller set the environment stops before any rank."""
    cfg = pod_config(templates(colocated[0])[1].spec.containers[0].args)
    for key in ("LWS_LEADER_ADDRESS", "LWS_WORKER_INDEX", "LWS_GROUP_SIZE"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(RuntimeError, match="LWS_LEADER_ADDRESS, LWS_WORKER_INDEX, LWS_GROUP_SIZE"):
        lws_pod_main(cfg, None)


# ---- PD: prefill 1 pod x 8 GPUs, decode 2 groups of 2 pods x 8, SGLang's router ----------------
@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    return render_cli(tmp_path_factory.mktemp("lws_pd"), "cluster.lws.mode=pd", PREFILL_1x8,
                      "cluster.lws.decode.replicas=2", "cluster.lws.namespace=llm",
                      "disaggregation.bootstrap_port=9100")


def test_pd_sets(pd):
    prefill, decode = pd[:2]
    assert [d["metadata"]["name"] for d in pd] == [
        "moeserve-prefill", "moeserve-decode", "moeserve-router", "moeserve-router"]
    sizes = {"prefill": (1, 1), "decode": (2, 2)}  # (replicas, pods per group)
    for role, lws in (("prefill", prefill), ("decode", decode)):
        spec = lws["spec"]
        assert (spec["replicas"], spec["leaderWorkerTemplate"]["size"]) == sizes[role]
        leader, worker = templates(lws)
        (c,) = leader.spec.containers
        assert c.resources.limits == {"nvidia.com/gpu": "8"}
        assert [a for a in c.args if a.startswith("disaggregation.")] == [
            "disaggregation.bootstrap_port=9100", f"disaggregation.mode={role}"]
        cfg = pod_config(c.args)
        assert cfg.parallel.nnodes == sizes[role][1] and cfg.disaggregation.mode == role
        assert cfg.disaggregation.bootstrap_port == 9100  # the user's, the router's too
        assert cfg.parallel.tp_size // cfg.parallel.nnodes == 8 and cfg.cluster.lws.in_pod
        ports = {p.name: p.container_port for p in c.ports}
        assert ports == ({"http": 30000, "bootstrap": 9100} if role == "prefill"
                         else {"http": 30000})
        assert worker.spec.containers[0].args == c.args


def test_pd_router(pd):
    """The router's command, parsed by sglang-router itself, names each group's leader (the
    LWS_LEADER_ADDRESS form) with the prefill side's bootstrap port."""
    parse_router_args = pytest.importorskip("sglang_router.launch_router").parse_router_args
    d = k8s(pd[2], "V1Deployment")
    assert d.spec.selector.match_labels == d.spec.template.metadata.labels
    (c,) = d.spec.template.spec.containers
    assert c.command == ["python", "-m", "sglang_router.launch_router"] and c.resources is None
    args = parse_router_args(c.args)
    assert args.pd_disaggregation and args.policy == "cache_aware"
    assert args.prefill_urls == [("http://moeserve-prefill-0.moeserve-prefill.llm:30000", 9100)]
    assert args.decode_urls == ["http://moeserve-decode-0.moeserve-decode.llm:30000",
                                "http://moeserve-decode-1.moeserve-decode.llm:30000"]
    assert (args.host, args.port) == ("0.0.0.0", 8000)
    s = k8s(pd[3], "V1Service")
    assert s.spec.selector == d.spec.template.metadata.labels
    assert [(p.port, p.target_port) for p in s.spec.ports] == [(8000, "http")]
    assert [(p.name, p.container_port) for p in c.ports] == [("http", 8000)]


def test_cpu_pods_ask_for_no_gpu():
    cfg = compose(["+cluster=lws", "+deploy=tiny_cpu_2node", "model.path=/m",
                   "cluster.lws.image=x"])
    lws, _ = render(cfg, [])
    leader, _ = templates(lws)
    assert leader.spec.containers[0].resources is None


# ---- validation --------------------------------------------------------------------------------
@pytest.mark.parametrize("override,key", [
    ("cluster.lws.image=null", "cluster.lws.image"),
    ("cluster.lws.name=MoE", "cluster.lws.name"),
    ("cluster.lws.namespace=" + "n" * 41, "cluster.lws.namespace"),
    ("cluster.lws.memory=12GB", "cluster.lws.memory"),
    ("cluster.lws.shm_size=lots", "cluster.lws.shm_size"),
    ("+cluster.lws.env.NCCL-DEBUG=1", "cluster.lws.env"),
    ("cluster.lws.gpu_resource=''", "cluster.lws.gpu_resource"),
    ("cluster.lws.mode=disagg", "cluster.lws.mode"),
    ("cluster.lws.replicas=0", "cluster.lws.replicas"),
    ("cluster.lws.decode.replicas=0", "cluster.lws.decode.replicas"),
    ("cluster.lws.router_policy=fastest", "cluster.lws.router_policy"),
    ('cluster.lws.prefill.overrides=["+parallel.x=1"]', "cluster.lws.prefill.overrides"),
])
def test_bad_keys_are_refused(override, key):
    with pytest.raises(ConfigError) as e:
        compose([*BASE, override])
    assert e.value.key == key


@pytest.mark.parametrize("role_override", ['"parallel.ep_size=8"', '"parallel=dp8_ep8"'])
def test_bad_role_overrides_name_the_role(role_override, tmp_path):
    """A role whose overrides make no valid config: ConfigError at render; the CLI exits 2."""
    cfg = compose([*BASE, "cluster.lws.mode=pd", f"cluster.lws.decode.overrides=[{role_override}]"])
    with pytest.raises(ConfigError) as e:
        render(cfg, [])
    assert e.value.key == "cluster.lws.decode.overrides"


def test_quantities_as_kubernetes_parses_them():
    """Our check of cpu/memory/shm_size agrees with the client's parser ('10 Gi', which the
    client's lenient parser takes and the API server does not, aside)."""
    samples = ["16", "500m", "64Gi", "1.5Gi", "2e3", "100M", "1k", "1E", "12GB", "Gi", "1.5.2",
               "abc", "1e", "64gi"]
    for q in samples:
        try:
            parse_quantity(q)
            ok = True
        except ValueError:
            ok = False
        refused = False
        try:
            compose([*BASE, f"cluster.lws.memory={q}"])
        except ConfigError:
            refused = True
        assert ok != refused, q
