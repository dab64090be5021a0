"""Every shipped composition composes against the typed schema and validates (GPU ones included,
nothing started); bad overrides exit non-zero before any process starts, naming the key; `-m`
sweeps compose each point."""

from __future__ import annotations

import glob
import os
import subprocess
import sys

import pytest

from moeserve.config import GROUP_SCHEMAS, ConfigError, compose

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONF = os.path.join(REPO, "conf")


def options(group: str) -> list[str]:
    return sorted(os.path.basename(f)[:-5] for f in glob.glob(os.path.join(CONF, group, "*.yaml")))


def cli(module: str, *args: str, timeout: float = 60,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, check=False,
                          env={**os.environ, **(env or {})})


# What each deployment preset must give: (tp, dp, ep, nnodes, redundant experts, device, extra).
DEPLOY = {
    "deepseek_v3_1x8": (8, 8, 8, 1, 0, "cuda", ["model.path=/models/DeepSeek-V3"]),
    "deepseek_v3_2x8": (16, 16, 16, 2, 32, "cuda",
                        ["model.path=/models/DeepSeek-V3", "+cluster=slurm"]),
    "deepseek_v2_lite_1x2": (2, 2, 2, 1, 0, "cuda", ["model.path=/models/DeepSeek-V2-Lite"]),
    "qwen3_30b_a3b_1x4": (4, 4, 4, 1, 0, "cuda", ["model.path=/models/Qwen3-30B-A3B"]),
    "llama_1x1": (1, 1, 1, 1, 0, "cuda", ["model.path=/models/Llama-3-8B"]),
    "tiny_cpu": (1, 1, 1, 1, 0, "cpu", []),
    "tiny_cpu_dp2": (2, 2, 2, 1, 0, "cpu", []),
    "tiny_cpu_2node": (2, 2, 2, 2, 0, "cpu", ["+cluster=local_2node"]),
}


def test_every_deploy_preset_is_covered():  # pd_*: tests/config/test_pd_presets.py
    assert sorted(DEPLOY) == [o for o in options("deploy") if not o.startswith("pd_")]


@pytest.mark.parametrize("name", sorted(DEPLOY))
def test_deploy_preset_composes_and_validates(name):
    tp, dp, ep, nnodes, redundant, device, extra = DEPLOY[name]
    cfg = compose([f"+deploy={name}", *extra])
    p = cfg.parallel
    assert (p.tp_size, p.dp_size, p.ep, p.nnodes) == (tp, dp, ep, nnodes)
    assert cfg.eplb.num_redundant_experts == redundant and cfg.device == device
    assert cfg.tbo.enabled is False and cfg.spec.algorithm == "none"


@pytest.mark.parametrize("name", ["deepseek_v3_1x8", "deepseek_v3_2x8"])
def test_deepseek_v3_presets_keep_fp8_checkpoints_in_fp8(name):
    cfg = compose([f"+deploy={name}", *DEPLOY[name][-1]])
    assert cfg.model.quantization == "auto"
    cfg = compose([f"+deploy={name}", *DEPLOY[name][-1], "model.quantization=none"])
    assert cfg.model.quantization == "none"


def test_real_models_need_a_path():
    for name in ("deepseek_v3_1x8", "qwen3_30b_a3b_1x4", "llama_1x1"):
        with pytest.raises(ConfigError, match="model.path"):
            compose([f"+deploy={name}"])
    assert compose([]).model.path is None  # the embedded default needs none


def test_two_node_preset_needs_a_multinode_cluster():
    with pytest.raises(ConfigError, match="parallel.nnodes"):
        compose(["+deploy=deepseek_v3_2x8", "model.path=/m"])  # cluster=local: one node


def test_defaults_reproduce_the_schema_defaults():
    from moeserve.config import MoeserveConfig

    assert compose([]) == MoeserveConfig()
    # group choices do not pin values that plain overrides rely on: tp/dp keep ep = tp
    assert compose(["parallel.tp_size=2", "parallel.dp_size=2"]).parallel.ep == 2


def test_every_group_has_a_schema_and_its_options_compose():
    from hydra.core.config_store import ConfigStore

    from moeserve.config import register_configs

    register_configs()  # as compose() does, so the test also passes when run alone
    repo = ConfigStore.instance().repo
    extra = {"model": ["model.path=/m"], "eplb": ["eplb.init_placement=/p.json"]}
    for group in ("model", "parallel", "scheduler", "server", "eplb", "tbo", "spec", "cluster"):
        assert group in GROUP_SCHEMAS and f"{group}_schema.yaml" in repo[group]
        assert options(group), group
        for opt in options(group):
            overrides = [f"{group}={opt}" if group != "cluster" else f"+cluster={opt}"]
            overrides += extra.get(group, [])
            if group == "parallel" and opt.endswith(("2node", "dp16_ep16")):
                overrides.append("+cluster=local_2node" if opt.endswith("2node") else "+cluster=slurm")
            if group == "cluster" and opt != "local":
                overrides.append("parallel=dp2_ep2_2node")
            if group == "cluster" and opt == "lws":
                overrides.append("cluster.lws.image=registry.example/moeserve:1")  # required
            compose(overrides)


@pytest.mark.parametrize("bad,key", [
    (["tbo=on", "tbo.min_tokens=0"], "tbo.min_tokens"),
    (["spec.algorithm=nextn", "spec.num_steps=0"], "spec.num_steps"),
    (["spec.draft_path=/nonexistent"], "spec.draft_path"),
    (["eplb=static"], "eplb.init_placement"),
    (["+cluster=local_2node"], "parallel.nnodes"),
    (["+cluster=slurm", "parallel=dp2_ep2_2node", "cluster.gpus_per_node=8"], "cluster.gpus_per_node"),
    (["parallel.tp_size=4", "parallel.dp_size=3"], "parallel.dp_size"),
    (["server.start_method=fork"], "server.start_method"),
])
def test_refused_combinations_name_the_key(bad, key):
    with pytest.raises(ConfigError) as e:
        compose(bad)
    assert e.value.key == key


# ---- the command line --------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_cfg_job_prints_every_preset_without_starting():
    for name, (tp, _, _, nnodes, _, device, extra) in DEPLOY.items():
        module = "launch.multinode" if any(e.startswith("+cluster") for e in extra) else "launch.server"
        out = cli(module, f"+deploy={name}", *extra, "--cfg", "job")
        assert out.returncode == 0, out.stderr
        for line in (f"tp_size: {tp}", f"nnodes: {nnodes}", f"device: {device}", "tbo:", "spec:",
                     "cluster:"):
            assert line in out.stdout, (name, line)


def ipc_files(tmp: str) -> set[str]:
    return set(glob.glob(os.path.join(tmp, "moeserve-*")))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("args,needle", [
    (["parallel.tpsize=2"], "Key 'tpsize' not in 'ParallelConfig'"),
    (["parallel.tp_size=two"], "parallel.tp_size"),
    (["scheduler.overlap=maybe"], "scheduler.overlap"),
    (["parallel=dp3"], "parallel"),
    (["parallel.tp_size=4", "parallel.dp_size=3"], "config error at 'parallel.dp_size'"),
    (["tbo.min_tokens=-1"], "config error at 'tbo.min_tokens'"),
    (["+deploy=deepseek_v3_1x8"], "config error at 'model.path'"),
])
def test_bad_override_fails_and_starts_nothing(args, needle, tmp_path):
    tmp = tmp_path / "tmp"  # the launch's own temp dir: other tests' servers (xdist) use theirs
    tmp.mkdir()
    out = cli("launch.server", *args, f"hydra.run.dir={tmp_path}",  # the test timeout bounds it
              env={"TMPDIR": str(tmp)})
    assert out.returncode != 0
    assert needle in out.stderr, out.stderr[-2000:]
    assert "started" not in out.stderr and "started" not in out.stdout  # no child process
    assert ipc_files(str(tmp)) == set()


@pytest.mark.timeout(60)
def test_multirun_sweep_composes_each_point(tmp_path):
    out = cli("launch.multinode", "-m", "+cluster=local", "cluster.dry_run=true",
              "cache.max_running_requests=64,128", f"hydra.sweep.dir={tmp_path}")
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("cluster.dry_run: would start local") == 2
    for i, n in enumerate((64, 128)):
        saved = (tmp_path / str(i) / ".hydra" / "config.yaml").read_text()
        assert f"max_running_requests: {n}" in saved


@pytest.mark.timeout(60)
def test_resolved_config_saved_in_run_dir(tmp_path):
    out = cli("launch.multinode", "+cluster=local_2node", "+deploy=tiny_cpu_2node",
              "cluster.dry_run=true", f"hydra.run.dir={tmp_path}")
    assert out.returncode == 0, out.stderr
    assert "nnodes: 2" in out.stdout and f"run dir: {tmp_path}" in out.stdout
    saved = (tmp_path / ".hydra" / "config.yaml").read_text()
    assert "kind: local_2node" in saved and "tp_size: 2" in saved
