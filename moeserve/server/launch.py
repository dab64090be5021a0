"""`serve(cfg)`: start the detokenizer, the DP controller (dp_size > 1) and one scheduler process
per rank, wait for their ready handshakes, then run the HTTP server in this (main) process until a
signal or a child's death. `serve_node(cfg)`: a node other than 0, its ranks only.

Shutdown contract (docs/architecture.md §2): SIGTERM while serving drains first (guard.py: new
requests 503, in-flight ones up to server.shutdown_timeout_s); SIGINT/SIGTERM → children
terminated and joined, exit 0; a child dying at any time → a log line naming it, the others
terminated, exit 1; no orphans (children die with the launcher, see procs/children.py); the
ipc:// socket files are removed. The processes themselves are started by moeserve.procs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from moeserve.config import MoeserveConfig
from moeserve.ipc.queues import Endpoints
from moeserve.procs.children import ChildDied, ProcessGroup, setup_logging
from moeserve.procs.ipc_files import remove_ipc_files
from moeserve.procs.ranks import node_ranks, start_ranks
from moeserve.procs.rendezvous import with_rendezvous
from moeserve.procs.supervise import exit_on_child_death, interrupt_on_signals

logger = logging.getLogger("moeserve.server")


def _start_ranks(procs: ProcessGroup, cfg: MoeserveConfig, model_path: str, endpoints: Endpoints,
                 scheduler_target: Callable[..., None] | None) -> set[tuple[str, int]]:
    """procs/ranks.py with the real roles: the DP controller and the scheduler process (unless
    `scheduler_target` replaces it)."""
    from moeserve.dp_attention.controller import run_controller_process
    from moeserve.scheduler.process import run_scheduler_process

    return start_ranks(procs, cfg, model_path, endpoints,
                       scheduler_target or run_scheduler_process, run_controller_process)


def serve(cfg: MoeserveConfig, scheduler_target: Callable[..., None] | None = None,
          log_file: str | None = None, endpoints: Endpoints | None = None,
          start_first: Callable[[ProcessGroup], None] | None = None) -> int:
    """Run the server (node 0) until shutdown; returns the process exit code (0: signal,
    1: failure).

    `scheduler_target(cfg, model_path, endpoints, rank)` replaces the real scheduler (tests);
    `log_file` gets every process's log lines too; `endpoints` (default: fresh ipc:// ones) are
    tcp:// ones when other nodes run ranks; `start_first(procs)` starts extra supervised children
    before the others (local_2node: node 1's process tree)."""
    from moeserve.models.embedded import embedded_model_path
    from moeserve.tokenizer.detokenizer import run_detokenizer_process

    setup_logging(cfg.server.log_level, log_file)
    model_path = cfg.model.path or embedded_model_path()
    cfg = with_rendezvous(cfg)
    endpoints = endpoints or Endpoints.fresh(cfg.parallel.dp_size)
    procs = ProcessGroup(cfg.server.log_level, log_file, cfg.server.start_method)
    interrupt_on_signals()
    store = None  # elastic EP: the launcher hosts the membership store (outlives any rank)
    try:
        if cfg.parallel.elastic_ep:
            from moeserve.elastic.supervisor import host_store

            store = host_store(cfg)
        if start_first is not None:
            start_first(procs)
        procs.start("detokenizer", run_detokenizer_process, (model_path, endpoints))
        expected = _start_ranks(procs, cfg, model_path, endpoints, scheduler_target)
        rank_target = scheduler_target or _scheduler_process
        asyncio.run(_serve_http(cfg, model_path, endpoints, procs, expected, rank_target))
        return 0
    except KeyboardInterrupt as e:
        logger.info("received %s; shutting down", e or "interrupt")
        return 0
    except (ChildDied, TimeoutError) as e:
        logger.error("start-up failed: %s", e)
        return 1
    finally:
        procs.stop()
        remove_ipc_files(endpoints)
        del store  # elastic EP's membership store ends with the children
        logger.info("all child processes stopped")


def serve_node(cfg: MoeserveConfig, endpoints: Endpoints, log_file: str | None = None,
               scheduler_target: Callable[..., None] | None = None) -> int:
    """A node other than 0: run only this node's scheduler ranks (they connect to node 0's
    tcp:// endpoints and torch.distributed rendezvous) until a signal (exit 0) or a rank's death
    (exit 1, the other ranks stopped)."""
    from moeserve.models.embedded import embedded_model_path

    if cfg.parallel.node_rank == 0 or cfg.parallel.dist_init_addr is None:
        raise ValueError("serve_node runs a node_rank > 0 with parallel.dist_init_addr set")
    setup_logging(cfg.server.log_level, log_file)
    model_path = cfg.model.path or embedded_model_path()
    procs = ProcessGroup(cfg.server.log_level, log_file, cfg.server.start_method)
    interrupt_on_signals()
    try:
        _start_ranks(procs, cfg, model_path, endpoints, scheduler_target)
        procs.start_watchdog(lambda child: exit_on_child_death(child, procs, endpoints))
        logger.info("node %d: ranks %s started; rendezvous %s", cfg.parallel.node_rank,
                    list(node_ranks(cfg)), cfg.parallel.dist_init_addr)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt as e:
        logger.info("node %d received %s; shutting down", cfg.parallel.node_rank, e or "interrupt")
        return 0
    finally:
        procs.stop()
        logger.info("node %d: all child processes stopped", cfg.parallel.node_rank)


def _scheduler_process(*args: Any) -> None:
    from moeserve.scheduler.process import run_scheduler_process

    run_scheduler_process(*args)


async def _serve_http(cfg: MoeserveConfig, model_path: str, endpoints: Endpoints,
                      procs: ProcessGroup, expected: set[tuple[str, int]],
                      rank_target: Callable[..., None] = _scheduler_process) -> None:
    import uvicorn

    from moeserve.disaggregation.bootstrap import serve_bootstrap
    from moeserve.server.api import create_app
    from moeserve.server.guard import DrainingServer, RequestGate
    from moeserve.server.tokenizer_manager import TokenizerManager

    manager = TokenizerManager(cfg, model_path, endpoints, num_ranks=cfg.parallel.world_size)
    manager.start()
    expected = expected | {("detokenizer", 0)}
    await manager.wait_ready(expected, cfg.server.startup_timeout_s, procs.check_alive)
    if cfg.parallel.elastic_ep:  # a rank's death is survived (moeserve/elastic/)
        _start_elastic(cfg, model_path, endpoints, procs, manager, rank_target)
    else:
        procs.start_watchdog(lambda child: exit_on_child_death(child, procs, endpoints))
    bootstrap = serve_bootstrap(cfg, manager.ready)  # a PD prefill server's; else None
    gate = RequestGate(create_app(manager, cfg), cfg.server.max_request_bytes)
    server = DrainingServer(uvicorn.Config(
        gate, host=cfg.server.host, port=cfg.server.port,
        log_level=cfg.server.log_level.lower(), access_log=cfg.server.log_level == "debug",
        timeout_graceful_shutdown=5), gate, manager, cfg.server.shutdown_timeout_s)
    announce = asyncio.get_running_loop().create_task(_announce(server, manager, cfg))
    try:
        await server.serve()
    finally:
        announce.cancel()
        manager.close()
        if bootstrap is not None:
            bootstrap.close()


def _start_elastic(cfg: MoeserveConfig, model_path: str, endpoints: Endpoints,
                   procs: ProcessGroup, manager: Any, rank_target: Callable[..., None]) -> None:
    """The supervisor (a thread) and the manager's request ledger; relaunches run on the
    event loop's thread, the main one (PDEATHSIG follows the thread that forks)."""
    from moeserve.elastic.metrics import ElasticMetrics
    from moeserve.elastic.retry import RequestLedger
    from moeserve.elastic.supervisor import ElasticSupervisor

    loop = asyncio.get_running_loop()
    metrics = ElasticMetrics(manager.metrics.registry, cfg.parallel.world_size)
    manager.ledger = RequestLedger(manager.send, metrics)

    def relaunch(rank: int) -> None:
        loop.call_soon_threadsafe(procs.start, f"scheduler-{rank}", rank_target,
                                  (cfg, model_path, endpoints, rank))

    ElasticSupervisor(cfg, procs, endpoints, metrics,
                      lambda child: exit_on_child_death(child, procs, endpoints), relaunch,
                      lambda n: loop.call_soon_threadsafe(manager.set_num_ranks, n)).start()


async def _announce(server: Any, manager: Any, cfg: MoeserveConfig) -> None:
    while not server.started:
        await asyncio.sleep(0.05)
    info = rank_summary(manager.ready)
    logger.info("server ready on http://%s:%d (model %s: %d rank(s), KV capacity %s tokens in "
                "all, context %s, max running requests %s)", cfg.server.host, cfg.server.port,
                manager.served_model_name, info["ranks"], info.get("max_total_tokens"),
                info.get("max_req_len"), info.get("max_running_requests"))


def rank_summary(ready: dict[tuple[str, int], dict]) -> dict[str, Any]:
    """The schedulers' ready infos combined: KV capacity and running slots summed over ranks,
    context length the smallest (a request may land on any rank)."""
    infos = [info for (role, _), info in ready.items() if role == "scheduler"]
    out: dict[str, Any] = {"ranks": len(infos)}
    for key, combine in (("max_total_tokens", sum), ("max_running_requests", sum),
                         ("max_req_len", min)):
        values = [i[key] for i in infos if key in i]
        if values:
            out[key] = combine(values)
    return out
