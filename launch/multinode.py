"""`python -m launch.multinode +cluster=NAME [hydra overrides...]`: the ranks over one or more nodes.

    python -m launch.multinode +cluster=local +deploy=deepseek_v3_1x8 model.path=/models/DSV3
    python -m launch.multinode +cluster=local_2node +deploy=tiny_cpu_2node model.path=/tmp/tiny
    python -m launch.multinode +cluster=slurm +deploy=deepseek_v3_2x8 model.path=/models/DSV3 \\
        cluster.partition=gpu cluster.dry_run=true          # print the sbatch script only
    python -m launch.multinode -m +cluster=slurm cluster.dry_run=true ... \\
        scheduler.max_running_requests=64,128              # one sweep point each

Without `+cluster` the cluster is `local`. The resolved config is printed and saved in Hydra's run
dir (`.hydra/config.yaml`, `moeserve.log`). See moeserve/server/multinode.py.
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from launch.common import finish, resolved
from moeserve.config import register_configs


@hydra.main(config_path="pkg://conf", config_name="config", version_base="1.3")
def main(raw: DictConfig) -> int:
    from hydra.core.hydra_config import HydraConfig

    from moeserve.server.multinode import run

    cfg, log_file = resolved(raw)
    hc = HydraConfig.get()
    return finish(run(cfg, hc.runtime.output_dir, log_file, list(hc.overrides.task)))


if __name__ == "__main__":  # not at import: spawned children import this module again
    register_configs()
    main()
