"""Redundant experts and EPLB placements change where experts live, never what the model computes:
greedy outputs equal the plain model's (single rank here; dp/ep ranks in tests/multiproc)."""

from __future__ import annotations

import pytest
import torch
from parity import FP32_CPU, prefill_logits, prompts_of_lengths, rel_err, make_runner

from moeserve import Engine
from moeserve.eplb.location import ExpertLocation

GREEDY = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 16}


def _placement(path: str, tmp_path, layers: int, experts: int, redundant: int) -> str:
    load = torch.rand(layers, experts, generator=torch.Generator().manual_seed(3)) ** 4 * 1000
    loc = ExpertLocation.from_algorithm(load, ep_size=1, num_redundant=redundant)
    out = str(tmp_path / "placement.json")
    loc.save(out)
    return out


@pytest.mark.parametrize("arch,experts", [("qwen3_moe", 8), ("deepseek_v3", 16)])
def test_redundant_and_rebalanced_placements_keep_outputs(tiny_model, tmp_path, arch, experts):
    path = tiny_model(arch)
    prompts = prompts_of_lengths([5, 12, 9], 30000, seed=4)
    with Engine(path, FP32_CPU) as eng:
        plain = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=GREEDY)]
    base = make_runner(path)
    layers = base.hf_config.num_hidden_layers
    placement = _placement(path, tmp_path, layers, experts, redundant=4)
    for extra in (["eplb.num_redundant_experts=3"],
                  ["eplb.num_redundant_experts=4", f"eplb.init_placement={placement}"]):
        runner = make_runner(path, extra)
        assert runner.moe_parallel.location.num_physical == experts + int(extra[0][-1])
        for a, b in zip(prefill_logits(runner, prompts), prefill_logits(base, prompts)):
            assert rel_err(a, b) < 1e-5
        with Engine(path, FP32_CPU + extra) as eng:
            outs = [o["output_ids"] for o in eng.generate(input_ids=prompts,
                                                             sampling_params=GREEDY)]
        assert outs == plain


def test_placement_for_another_model_is_refused(tiny_model, tmp_path):
    path = tiny_model("qwen3_moe")
    placement = _placement(path, tmp_path, layers=1, experts=8, redundant=0)
    with pytest.raises(ValueError, match="placement has 1 layers"):
        make_runner(path, [f"eplb.init_placement={placement}"])
