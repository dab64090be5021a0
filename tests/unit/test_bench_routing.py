"""bench.one_batch's prefill routing line (bench/roofline.py): the pairs each expert got, recorded
through the EPLB recorder, and the line that says how evenly they spread."""

from __future__ import annotations

import torch

from moeserve.bench.roofline import routed_counts, routing_line


def test_routing_line_reads_the_spread_of_each_moe_layer():
    counts = torch.zeros(3, 8, dtype=torch.int64)
    counts[0] = torch.tensor([10, 10, 10, 10, 0, 0, 0, 0])  # 4 of 8 used, busiest 10 of 20
    counts[2] = torch.tensor([20, 5, 5, 5, 5, 0, 0, 0])  # 5 used, busiest 20 of 20 tokens
    line = routing_line(counts, 20, "prefill routing b=1")  # layer 1: dense, no pairs
    assert line == ("| prefill routing b=1: experts used a MoE layer 4-5 (median 4) of 8; the "
                    "busiest takes 50-100% of the 20 tokens")
    assert "no MoE layer" in routing_line(torch.zeros(2, 4, dtype=torch.int64), 5, "x")


def test_routed_counts_records_every_pair_and_restores_the_recorder(tiny_model):
    from moeserve.bench.one_batch import prefill_chunked
    from moeserve.config import compose
    from moeserve.runtime.model_runner import ModelRunner

    path = tiny_model("qwen3_moe")
    runner = ModelRunner(compose([f"model.path='{path}'", "device=cpu", "model.dtype=float32",
                                  "cuda_graph.enabled=false"]), path)
    mem, t = runner.memory, 24
    rows, slots = mem.req_to_token.alloc(1), mem.allocator.alloc(t)
    per_req = slots.view(1, t)
    mem.req_to_token.write(rows[0], 0, per_req[0])
    ids = [[(7 * i) % runner.hf_config.vocab_size for i in range(t)]]
    assert not runner.recorder.recording
    counts = routed_counts(runner, lambda: prefill_chunked(runner, ids, rows, per_req))
    k = runner.hf_config.num_experts_per_tok
    moe = counts[counts.sum(1) > 0]
    assert len(moe) > 0 and (moe.sum(1) == t * k).all()  # each token's K picks, per MoE layer
    assert not runner.recorder.recording
    again = routed_counts(runner, lambda: prefill_chunked(runner, ids, rows, per_req))
    assert torch.equal(again, counts)  # only the span's pairs: the same prompt, the same counts
