"""`python -m launch.server [hydra overrides...]`: serve a model over HTTP (OpenAI API) on one host.

With no arguments the embedded SmolLM2-135M-Instruct is served on 127.0.0.1:30000. Examples:

    python -m launch.server server.port=8000 model.path=/models/Qwen3-0.6B
    python -m launch.server +deploy=deepseek_v3_1x8 model.path=/models/DeepSeek-V3
    python -m launch.server +deploy=tiny_cpu model.path=/tmp/tiny --cfg job   # print, start nothing

The resolved config is printed and saved in Hydra's run dir (`outputs/<date>/<time>/.hydra/`, or
`hydra.run.dir=DIR`) beside `moeserve.log`. Unknown keys, wrong types and impossible combinations
exit non-zero before any process starts.
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from launch.common import finish, resolved
from moeserve.config import register_configs


@hydra.main(config_path="pkg://conf", config_name="config", version_base="1.3")
def main(raw: DictConfig) -> int:
    from moeserve.server.launch import serve

    cfg, log_file = resolved(raw)
    if cfg.cluster.kind != "local":
        raise SystemExit("launch.server runs one host: use `python -m launch.multinode "
                         f"+cluster={cfg.cluster.kind}`")
    return finish(serve(cfg, log_file=log_file))


if __name__ == "__main__":  # not at import: spawned children import this module again
    register_configs()
    main()
