"""`serve(cfg)`: start the detokenizer and scheduler processes, wait for their ready handshakes,
then run the HTTP server in this (main) process until a signal or a child's death.

Shutdown contract (DESIGN.md §2): SIGINT/SIGTERM → children terminated and joined, exit 0; a child
dying at any time → a log line naming it, the others terminated, exit 1; no orphans (children die
with the launcher, see children.py); the ipc:// socket files are removed.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Callable
from typing import Any

from moeserve.config import MoeserveConfig
from moeserve.ipc.queues import Endpoints
from moeserve.server.children import Child, ChildDied, ProcessGroup, setup_logging

logger = logging.getLogger("moeserve.server")


def _default_scheduler() -> Callable[..., None]:
    from moeserve.scheduler.process import run_scheduler_process

    return run_scheduler_process


def _raise_interrupt(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _remove_ipc_files(endpoints: Endpoints) -> None:
    for address in (endpoints.scheduler_in, endpoints.detokenizer_in, endpoints.manager_in):
        if address.startswith("ipc://"):
            try:
                os.unlink(address[len("ipc://"):])
            except OSError:
                pass


def serve(cfg: MoeserveConfig, scheduler_target: Callable[..., None] | None = None) -> int:
    """Run the server until shutdown; returns the process exit code (0: signal, 1: failure).

    `scheduler_target(cfg, model_path, endpoints, rank)` replaces the real scheduler (tests)."""
    from moeserve.models.embedded import embedded_model_path
    from moeserve.tokenizer.detokenizer import run_detokenizer_process

    setup_logging(cfg.server.log_level)
    model_path = cfg.model.path or embedded_model_path()
    endpoints = Endpoints.fresh()
    procs = ProcessGroup(cfg.server.log_level)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    signal.signal(signal.SIGINT, _raise_interrupt)
    try:
        procs.start("detokenizer", run_detokenizer_process, (model_path, endpoints))
        procs.start("scheduler-0", scheduler_target or _default_scheduler(),
                    (cfg, model_path, endpoints, 0))
        asyncio.run(_serve_http(cfg, model_path, endpoints, procs))
        return 0
    except KeyboardInterrupt as e:
        logger.info("received %s; shutting down", e or "interrupt")
        return 0
    except (ChildDied, TimeoutError) as e:
        logger.error("start-up failed: %s", e)
        return 1
    finally:
        procs.stop()
        _remove_ipc_files(endpoints)
        logger.info("all child processes stopped")


async def _serve_http(cfg: MoeserveConfig, model_path: str, endpoints: Endpoints,
                      procs: ProcessGroup) -> None:
    import uvicorn

    from moeserve.server.api import create_app
    from moeserve.server.tokenizer_manager import TokenizerManager

    manager = TokenizerManager(cfg, model_path, endpoints)
    manager.start()
    expected = {("detokenizer", 0), ("scheduler", 0)}
    await manager.wait_ready(expected, cfg.server.startup_timeout_s, procs.check_alive)
    procs.start_watchdog(lambda child: _on_child_death(child, procs, endpoints))
    server = uvicorn.Server(uvicorn.Config(
        create_app(manager, cfg), host=cfg.server.host, port=cfg.server.port,
        log_level=cfg.server.log_level.lower(), access_log=cfg.server.log_level == "debug",
        timeout_graceful_shutdown=5))
    announce = asyncio.get_running_loop().create_task(_announce(server, manager, cfg))
    try:
        await server.serve()
    finally:
        announce.cancel()
        manager.close()


async def _announce(server: Any, manager: Any, cfg: MoeserveConfig) -> None:
    while not server.started:
        await asyncio.sleep(0.05)
    info = manager.scheduler_info
    logger.info("server ready on http://%s:%d (model %s: KV capacity %s tokens, context %s, "
                "max running requests %s)", cfg.server.host, cfg.server.port,
                manager.served_model_name, info.get("max_total_tokens"), info.get("max_req_len"),
                info.get("max_running_requests"))


def _on_child_death(child: Child, procs: ProcessGroup, endpoints: Endpoints) -> None:
    """Watchdog callback (a thread): one child died, so the whole server goes down with exit 1."""
    logger.error("child process '%s' (pid %s) died with exit code %s; shutting the server down",
                 child.name, child.process.pid, child.process.exitcode)
    procs.stop()
    _remove_ipc_files(endpoints)
    logging.shutdown()
    os._exit(1)
