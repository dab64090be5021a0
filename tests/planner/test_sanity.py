"""The planner's answers behave as a deployment does: throughput falls as the ITL budget
tightens, a plan that does not fit memory is refused with its numbers, and a plan it writes is
a preset the runtime composes."""

from __future__ import annotations

import pytest

from moeserve.config import compose
from moeserve.planner import Deployment, Role, Workload, predict
from moeserve.planner.__main__ import main
from moeserve.planner.sweep import SweepSpace, best, cost_model, sweep_decode

W = Workload(2000, 100)


@pytest.fixture(scope="module")
def decode_plans():
    space = SweepSpace(nodes=(4, 9), batches=(16, 64, 256), tbo=(True,))
    return sweep_decode("deepseek_v3", cost_model("h100", "best"), W, "fp8", space)


def test_throughput_falls_as_itl_tightens(decode_plans):
    by_batch = sorted((p for p in decode_plans if p.role.nodes == 9), key=lambda p: p.role.batch)
    itl = [p.latency_ms for p in by_batch]
    tput = [p.tok_s_gpu for p in by_batch]
    assert itl == sorted(itl) and tput == sorted(tput)  # bigger batches: slower, more output
    picks = [best(decode_plans, slo) for slo in (60.0, 80.0, 200.0)]
    assert all(p is not None for p in picks)
    assert picks[0].tok_s_gpu < picks[2].tok_s_gpu
    assert [p.tok_s_gpu for p in picks] == sorted(p.tok_s_gpu for p in picks)


def test_plan_that_does_not_fit_is_refused_with_numbers(capsys):
    dep = Deployment("deepseek_v3", "h100", "bf16", colocated=Role("colocated", 1, batch=64))
    pred = predict(dep, W)
    assert not pred.fits  # 671B parameters in bf16 over 8 x 80 GB
    assert pred.roles[0].memory.weights > pred.roles[0].memory.budget
    rc = main(["--model", "deepseek_v3", "--gpu", "h100", "--dtype", "bf16", "--batch", "64"])
    out = capsys.readouterr().out
    assert rc == 3 and "REFUSED" in out and "GiB of a" in out
    with pytest.raises(SystemExit, match="does not fit"):
        main(["--model", "deepseek_v3", "--gpu", "h100", "--dtype", "bf16", "--emit-deploy", "x"])


def test_emitted_deploy_preset_composes(tmp_path):
    rc = main(["--model", "deepseek_v3", "--gpu", "h200", "--nodes", "2", "--batch", "64",
               "--tbo", "--mtp", "1", "--accept-len", "1.8", "--graphs", "on",
               "--emit-deploy", "planned", "--deploy-dir", str(tmp_path)])
    assert rc == 0
    cfg = compose([f"hydra.searchpath=[file://{tmp_path}]", "+deploy=planned",
                   "model.path=/models/DeepSeek-V3", "+cluster=slurm"])
    p = cfg.parallel
    assert (p.tp_size, p.dp_size, p.ep, p.nnodes) == (16, 16, 16, 2)
    assert cfg.tbo.enabled and cfg.spec.algorithm == "nextn" and cfg.spec.num_steps == 1
    assert cfg.eplb.num_redundant_experts == 32 and cfg.model.quantization == "auto"
