"""The command lines the pods run: a moeserve node (`launch.multinode` with the user's Hydra
overrides plus the role's and the pod's own) and SGLang's router in front of a PD deployment."""

from __future__ import annotations

from moeserve.config import LWSConfig

NODE_COMMAND = ["python", "-m", "launch.multinode"]
ROUTER_COMMAND = ["python", "-m", "sglang_router.launch_router"]
# Overrides that only shape the manifests (or this machine's run dir): not passed to the pods.
_RENDER_ONLY = ("hydra.", "cluster.lws.", "cluster.dry_run")


def override_key(override: str) -> str:
    """'+cluster.lws.env.X=1' → 'cluster.lws.env.X'."""
    return override.split("=", 1)[0].lstrip("+~")


def node_args(task_overrides: list[str], extra: list[str]) -> list[str]:
    """The user's overrides less the render-only ones and those `extra` sets, then `extra`."""
    replaced = {override_key(o) for o in extra}
    kept = [o for o in task_overrides
            if not override_key(o).startswith(_RENDER_ONLY) and override_key(o) not in replaced]
    return kept + list(extra)


def pod_overrides(w: LWSConfig) -> list[str]:
    """What every pod adds: run its node from the LWS environment, listen on the pod's address
    (the Service and the router reach it there), keep its run dir in the container."""
    return ["cluster.lws.in_pod=true", "server.host=0.0.0.0", f"hydra.run.dir={w.pod_run_dir}"]


def pd_overrides(mode: str) -> list[str]:
    """The disaggregation role of a prefill or decode pod (docs/deploy_k8s.md). The rest of
    disaggregation.* (bootstrap port, transfer backend) reaches the pods as the user's or the
    role's own overrides: one place, the config both the pods and the router read."""
    return [f"disaggregation.mode={mode}"]


def router_args(prefill_urls: list[str], bootstrap_port: int, decode_urls: list[str],
                w: LWSConfig) -> list[str]:
    """`sglang_router.launch_router --pd-disaggregation`: every prefill server with its bootstrap
    port, every decode server."""
    args = ["--pd-disaggregation"]
    for url in prefill_urls:
        args += ["--prefill", url, str(bootstrap_port)]
    for url in decode_urls:
        args += ["--decode", url]
    return args + ["--host", "0.0.0.0", "--port", str(w.router_port), "--policy", w.router_policy]
