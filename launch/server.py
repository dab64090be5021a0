"""`python -m launch.server [hydra overrides...]`: serve a model over HTTP (OpenAI API) on one host.

With no arguments the embedded SmolLM2-135M-Instruct is served on 127.0.0.1:30000. Examples:

    python -m launch.server server.port=8000 model.path=/models/Qwen3-0.6B
    python -m launch.server server.api_key=sk-local model.context_length=4096

Hydra's own output folder and log files are switched off (the server logs to stderr) unless the
command line sets them.
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig, OmegaConf

from moeserve.config import register_configs, to_config

# Hydra settings that keep a server from writing outputs/<date>/ folders into the working directory.
_QUIET_HYDRA = {
    "hydra.output_subdir": "null",
    "hydra.run.dir": ".",
    "hydra/job_logging": "none",
    "hydra/hydra_logging": "none",
}

register_configs()


@hydra.main(config_path="pkg://conf", config_name="config", version_base="1.3")
def main(raw: DictConfig) -> None:
    from moeserve.server.launch import serve

    print(OmegaConf.to_yaml(raw), flush=True)
    sys.exit(serve(to_config(raw)))


def _with_quiet_hydra(argv: list[str]) -> list[str]:
    """Append the quiet defaults for every key the user did not set."""
    given = {a.split("=", 1)[0].lstrip("+~") for a in argv[1:]}
    return argv + [f"{k}={v}" for k, v in _QUIET_HYDRA.items() if k not in given]


if __name__ == "__main__":
    sys.argv = _with_quiet_hydra(sys.argv)
    main()
