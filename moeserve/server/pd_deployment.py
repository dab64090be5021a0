"""A whole PD deployment on one host (`launch.multinode +cluster=local` with
disaggregation.deployment=true, e.g. `+deploy=pd_tiny_cpu`): N prefill servers, M decode servers
and SGLang's router in PD mode in front, each a supervised child of this process. Any child exiting
takes the deployment down (exit 1, naming it); SIGTERM/SIGINT stop every child.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import time

from moeserve.config import MoeserveConfig
from moeserve.procs.children import ProcessGroup
from moeserve.procs.rendezvous import free_tcp_port
from moeserve.procs.supervise import interrupt_on_signals

logger = logging.getLogger("moeserve.pd_deployment")

_OWN_KEYS = ("cluster", "hydra.run.dir", "server.port", "disaggregation.deployment",
             "disaggregation.bootstrap_port", "disaggregation")


def role_argv(base: list[str], role: str, port: int, extra: list[str], run_dir: str,
              cpus: str | None, gpus: str | None = None,
              bootstrap_port: int | None = None, frontend_cpus: str | None = None,
              nice: int = 0) -> list[str]:
    """`python -m launch.server` for one role: the deployment's overrides minus the keys set
    here, then the role's, then its own port (and bootstrap port). `cpus` pins the server, or
    with `frontend_cpus` its scheduler ranks alone (the rest runs on frontend_cpus); `nice`
    lowers the whole server's priority."""
    kept = [o for o in base if o.split("=", 1)[0].lstrip("+~") not in _OWN_KEYS]
    argv = [sys.executable, "-m", "launch.server", *kept, "disaggregation.deployment=false",
            f"disaggregation={role}", f"server.port={port}", f"hydra.run.dir={run_dir}", *extra]
    if bootstrap_port is not None:
        argv.append(f"disaggregation.bootstrap_port={bootstrap_port}")
    if cpus is not None and frontend_cpus is not None:
        argv, cpus = [*argv, f"scheduler.cpus={cpus}"], frontend_cpus
    argv = pinned(argv, cpus)
    if nice:
        argv = ["nice", "-n", str(nice), *argv]
    return argv if gpus is None else ["env", f"CUDA_VISIBLE_DEVICES={gpus}", *argv]


def pinned(argv: list[str], cpus: str | None) -> list[str]:
    if cpus is None:
        return argv
    if shutil.which("taskset") is None:
        raise SystemExit("disaggregation.*_cpus needs `taskset` (util-linux)")
    return ["taskset", "-c", cpus, *argv]


def router_argv(host: str, port: int, prefills: list[tuple[int, int]],
                decodes: list[int], metrics_port: int) -> list[str]:
    argv = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
            "--host", host, "--port", str(port), "--prometheus-host", host,
            "--prometheus-port", str(metrics_port)]
    for http, boot in prefills:
        argv += ["--prefill", f"http://{host}:{http}", str(boot)]
    for http in decodes:
        argv += ["--decode", f"http://{host}:{http}"]
    return argv


def exec_argv(argv: list[str]) -> None:
    """Child target: become `argv` (same pid: supervised, and it dies with this process)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvp(argv[0], argv)


def run_pd_local(cfg: MoeserveConfig, run_dir: str, task_overrides: list[str]) -> int:
    d, host = cfg.disaggregation, cfg.server.host
    procs = ProcessGroup(cfg.server.log_level)
    prefills = [(free_tcp_port(host), free_tcp_port(host)) for _ in range(d.prefill_servers)]
    decodes = [free_tcp_port(host) for _ in range(d.decode_servers)]
    interrupt_on_signals()
    try:
        for i, (http, boot) in enumerate(prefills):
            procs.start(f"prefill-{i}", exec_argv, (role_argv(
                task_overrides, "prefill", http, list(d.prefill_overrides),
                os.path.join(run_dir, f"prefill{i}"), d.prefill_cpus, d.prefill_gpus, boot,
                d.frontend_cpus, d.prefill_nice),))
        for i, http in enumerate(decodes):
            procs.start(f"decode-{i}", exec_argv, (role_argv(
                task_overrides, "decode", http, list(d.decode_overrides),
                os.path.join(run_dir, f"decode{i}"), d.decode_cpus, d.decode_gpus,
                frontend_cpus=d.frontend_cpus),))
        metrics = d.router_metrics_port or free_tcp_port(host)
        procs.start("router", exec_argv, (pinned(
            router_argv(host, d.router_port, prefills, decodes, metrics), d.frontend_cpus),))
        print(f"PD deployment: router on http://{host}:{d.router_port}, prefill "
              f"{[f'{host}:{p}' for p, _ in prefills]}, decode "
              f"{[f'{host}:{p}' for p in decodes]}", flush=True)
        while procs.dead() is None:
            time.sleep(0.5)
        child = procs.dead()
        logger.error("%s exited with %s: stopping the deployment", child.name,
                     child.process.exitcode)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        _terminate(procs)


def _terminate(procs: ProcessGroup, timeout: float = 20.0) -> None:
    """SIGTERM first (servers drain, the router exits), then the group's own stop."""
    procs.stopping.set()
    for c in procs.children:
        if c.process.is_alive():
            os.kill(c.process.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for c in procs.children:
        c.process.join(max(0.0, deadline - time.monotonic()))
    procs.stop(timeout=5)
