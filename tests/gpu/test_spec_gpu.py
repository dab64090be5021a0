"""Speculative decoding on one GPU with CUDA graphs (the target's decode graphs run the verify
passes, the draft's graphs its chain steps and extends): float32 greedy outputs equal plain
decoding's, for the tiny DeepSeek-V3's MTP layer and a random NextN head on Llama, chains and
draft trees (spec.topk=2), and the oracle draft (accepted blocks of every length; for trees, paths
through any child) gives the plain tokens and logprobs."""

from __future__ import annotations

import pytest
from parity import prompts_of_lengths
from spec_oracle import install_oracle_draft, install_oracle_tree

from moeserve import Engine

pytestmark = pytest.mark.gpu

FP32_CUDA = ["device=cuda", "model.dtype=float32", "cuda_graph.max_bs=64"]
GREEDY = {"temperature": 0, "max_new_tokens": 20, "ignore_eos": True}


@pytest.mark.parametrize("arch,draft", [("deepseek_v3", []), ("llama", ["spec.draft_path=dummy"]),
                                        ("deepseek_v3", ["spec.topk=2"]),
                                        ("llama", ["spec.draft_path=dummy", "spec.topk=2"]),
                                        ("llama", ["spec.draft_path=dummy", "spec.topk=4",
                                                   "spec.num_draft_tokens=7"])])
def test_spec_with_graphs_equals_plain(tiny_model, arch, draft):
    path = tiny_model(arch)
    prompts = prompts_of_lengths([5, 17, 9, 30, 3, 12, 21, 8], 1000, seed=3)
    with Engine(path, FP32_CUDA) as eng:
        plain = eng.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
    tree = any(o.startswith("spec.topk=") for o in draft)  # 14 or 6 nodes a request
    spec = ["spec.algorithm=nextn", "spec.max_batch_size=0", "spec.num_steps=3", *draft]
    base = [o for o in FP32_CUDA if not tree or "max_bs" not in o]
    with Engine(path, base + (["cuda_graph.max_bs=128"] if tree else []) + spec) as eng:
        assert eng.runner.graph_runner is not None and eng.runner.draft_graphs is not None
        outs = eng.generate(input_ids=prompts, sampling_params=GREEDY)
        assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in plain]
        reference = {tuple(p): o["output_ids"] for p, o in zip(prompts, plain)}
        (install_oracle_tree if tree else install_oracle_draft)(eng, reference, 0.3, seed=2)
        outs = eng.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
        assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in plain]
        for o, p in zip(outs, plain):
            assert o["meta"]["output_logprobs"] == pytest.approx(p["meta"]["output_logprobs"],
                                                                 abs=1e-3)
        assert sum(o["meta"]["spec_accept_length"] for o in outs) / len(outs) > 1.5
        assert eng.scheduler.is_memory_clean()
