"""PD deployment presets (conf/deploy/pd_*.yaml): each composes, validates and gives its roles'
layout; the one-host deployments name what each role's servers get."""

from __future__ import annotations

import pytest
from test_compositions import options

from moeserve.config import compose
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
