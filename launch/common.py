"""What both launchers do inside `@hydra.main`: validate, print and record the resolved config,
and end the job (sys.exit for a single run; return the code for each point of a `-m` sweep)."""

from __future__ import annotations

import os
import sys

from omegaconf import DictConfig, OmegaConf

from moeserve.config import ConfigError, MoeserveConfig, to_config


def resolved(raw: DictConfig) -> tuple[MoeserveConfig, str]:
    """The validated config and the run's log file (<hydra run dir>/moeserve.log); prints the
    resolved YAML (also saved by Hydra as <run dir>/.hydra/config.yaml). A ConfigError exits 2
    before anything starts."""
    from hydra.core.hydra_config import HydraConfig

    try:
        cfg = to_config(raw)
    except ConfigError as e:
        print(f"moeserve: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    from moeserve.procs.children import setup_logging

    run_dir = HydraConfig.get().runtime.output_dir
    print(OmegaConf.to_yaml(raw, resolve=True), flush=True)
    print(f"run dir: {run_dir}", flush=True)
    log_file = os.path.join(run_dir, "moeserve.log")
    setup_logging(cfg.server.log_level, log_file)
    return cfg, log_file


def finish(code: int) -> int:
    """Exit with `code` in a single run, without the interpreter's teardown, the fork server's
    included (procs/exit.py, procs/forkserver.py: 1.4 and 0.75 CPU-s a server, after its
    children had stopped); in a multirun sweep return it so the next point runs."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from moeserve.procs.exit import exit_now
    from moeserve.procs.forkserver import end_fork_server

    if HydraConfig.get().mode == RunMode.MULTIRUN:
        return code
    end_fork_server()
    exit_now(code)
