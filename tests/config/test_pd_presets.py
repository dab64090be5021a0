"""PD deployment presets (conf/deploy/pd_*.yaml): each composes, validates and gives its roles'
layout; the one-host deployments name what each role's servers get."""

from __future__ import annotations

import pytest
from test_compositions import options

from moeserve.config import ConfigError, compose
from moeserve.server.pd_deployment import role_argv, router_argv

# name → (mode, deployment, dp, device, tbo, spec)
PD = {
    "pd_tiny_cpu": (None, True, 1, "cpu", False, "none"),
    "pd_qwen3_30b_a3b_4p4d": (None, True, 4, "cuda", False, "none"),
    "pd_deepseek_v3_prefill_1x8": ("prefill", False, 8, "cuda", True, "nextn"),
    "pd_deepseek_v3_decode_1x8": ("decode", False, 8, "cuda", False, "nextn"),
}


def test_every_pd_preset_is_covered():
    assert sorted(PD) == [o for o in options("deploy") if o.startswith("pd_")]


@pytest.mark.parametrize("name", sorted(PD))
def test_pd_preset(name):
    mode, deployment, dp, device, tbo, spec = PD[name]
    cfg = compose([f"+deploy={name}", "model.path=/models/x"])
    d = cfg.disaggregation
    assert (d.mode, d.deployment, cfg.parallel.dp_size, cfg.device) == (mode, deployment, dp,
                                                                       device)
    assert cfg.tbo.enabled is tbo and cfg.spec.algorithm == spec


def test_one_host_deployment_commands():
    cfg = compose(["+deploy=pd_qwen3_30b_a3b_4p4d", "model.path=/m"])
    d = cfg.disaggregation
    argv = role_argv(["+cluster=local", "+deploy=pd_qwen3_30b_a3b_4p4d", "model.path=/m"],
                     "prefill", 31000, list(d.prefill_overrides), "/run/p0", None, d.prefill_gpus,
                     31001)
    assert argv[:2] == ["env", "CUDA_VISIBLE_DEVICES=0,1,2,3"]
    assert "+cluster=local" not in argv and "disaggregation=prefill" in argv
    assert argv.index("disaggregation.deployment=false") > argv.index(
        "+deploy=pd_qwen3_30b_a3b_4p4d")  # the preset's deployment=true is overridden
    assert argv[-1] == "disaggregation.bootstrap_port=31001" and "tbo.enabled=true" in argv
    r = router_argv("127.0.0.1", 8000, [(31000, 31001)], [32000], 31005)
    assert r[r.index("--prometheus-port") + 1] == "31005"  # never the router's fixed 29000
    assert r[r.index("--prefill"):] == ["--prefill", "http://127.0.0.1:31000", "31001",
                                         "--decode", "http://127.0.0.1:32000"]


def test_one_host_cpu_layout_commands():
    """prefill_nice lowers the whole prefill server's priority; with frontend_cpus a role's cpus
    pin its scheduler ranks alone (scheduler.cpus) and the front end and router go there."""
    cfg = compose(["+deploy=pd_tiny_cpu", "model.path=/m", "disaggregation.prefill_cpus=0",
                   "disaggregation.decode_cpus=1"])
    d = cfg.disaggregation
    assert d.prefill_nice == 10
    argv = role_argv(["model.path=/m"], "prefill", 31000, [], "/run/p0", d.prefill_cpus, None,
                     31001, nice=d.prefill_nice)
    assert argv[:6] == ["nice", "-n", "10", "taskset", "-c", "0"]
    assert not any(a.startswith("scheduler.cpus") for a in argv)
    argv = role_argv(["model.path=/m"], "decode", 32000, [], "/run/d0", d.decode_cpus,
                     frontend_cpus="0")
    assert argv[:3] == ["taskset", "-c", "0"] and argv[-1] == "scheduler.cpus=1"


@pytest.mark.parametrize("bad,key", [
    ("disaggregation.prefill_nice=-5", "disaggregation.prefill_nice"),
    ("disaggregation.prefill_nice=20", "disaggregation.prefill_nice"),
    ("disaggregation.frontend_cpus=1-0", "disaggregation.frontend_cpus"),
    ("disaggregation.decode_cpus=x", "disaggregation.decode_cpus"),
    ("scheduler.cpus=0-", "scheduler.cpus"),
])
def test_bad_cpu_layout_names_the_key(bad, key):
    with pytest.raises(ConfigError) as e:
        compose(["+deploy=pd_tiny_cpu", "model.path=/m", bad])
    assert e.value.key == key
