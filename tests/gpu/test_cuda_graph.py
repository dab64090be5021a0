"""CUDA graphs against eager steps on one GPU, for every architecture (bf16): decode graphs, and
extend (prefill) graphs.

Both runs use the same kernels (Triton attention, fused MoE, Triton norms), and every decode batch
here is a captured bucket size (all requests run together to the same length), so each GEMM sees
the same shapes with graphs on and off: greedy outputs must be identical token for token. The
extend-graph runs use prompts whose total length is a token bucket (no padding, the same shapes);
a padded extend step is compared by its logits.
"""

from __future__ import annotations

import pytest
import torch
from parity import prompts_of_lengths

from moeserve import Engine
from moeserve.config import compose
from moeserve.runtime.model_runner import ModelRunner

pytestmark = pytest.mark.gpu

ARCHS = ["llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", "deepseek_v2", "deepseek_v3"]
BF16_CUDA = ["device=cuda", "model.dtype=bfloat16"]


def _generate(path: str, prompts: list[list[int]], overrides: list[str]) -> list[list[int]]:
    with Engine(path, overrides=BF16_CUDA + overrides) as eng:
        outs = eng.generate(input_ids=prompts, sampling_params={
            "temperature": 0, "max_new_tokens": 24, "ignore_eos": True})
    return [o["output_ids"] for o in outs]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("num_prompts", [1, 8])
def test_graph_decode_is_token_identical_to_eager(tiny_model, arch, num_prompts):
    path = tiny_model(arch)
    prompts = prompts_of_lengths([5, 17, 9, 30, 3, 12, 21, 8][:num_prompts], 30000, seed=3)
    eager = _generate(path, prompts, ["cuda_graph.enabled=false"])
    graphs = _generate(path, prompts, ["cuda_graph.enabled=true", "cuda_graph.max_bs=16",
                                       "cuda_graph.max_extend_tokens=0"])
    assert graphs == eager


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("num_prompts", [1, 8])
def test_pdl_graphs_are_token_identical_to_plain_eager_launches(tiny_model, arch, num_prompts):
    """Programmatic dependent launches (kernels/triton/pdl.py) change when kernels start, never what
    they compute: graphs of PDL launches equal eager steps without PDL."""
    path = tiny_model(arch)
    prompts = prompts_of_lengths([5, 17, 9, 30, 3, 12, 21, 8][:num_prompts], 30000, seed=4)
    plain = _generate(path, prompts, ["cuda_graph.enabled=false", "model.pdl=false"])
    pdl = _generate(path, prompts, ["cuda_graph.enabled=true", "cuda_graph.max_bs=16",
                                    "cuda_graph.max_extend_tokens=0", "model.pdl=true"])
    assert pdl == plain


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("num_prompts", [1, 8])
def test_fp8_pdl_graphs_are_token_identical_to_plain_eager_launches(tiny_model, arch,
                                                                   num_prompts):
    """The FP8 paths with PDL (the W8A16 GEMV of Fp8Linear at batch 1, the FP8 fused MoE kernels)
    compute what their plain eager launches compute."""
    path = tiny_model(arch)
    prompts = prompts_of_lengths([5, 17, 9, 30, 3, 12, 21, 8][:num_prompts], 30000, seed=6)
    fp8 = ["model.quantization=fp8"]
    plain = _generate(path, prompts, fp8 + ["cuda_graph.enabled=false", "model.pdl=false"])
    pdl = _generate(path, prompts, fp8 + ["cuda_graph.enabled=true", "cuda_graph.max_bs=16",
                                          "cuda_graph.max_extend_tokens=0", "model.pdl=true"])
    assert pdl == plain


def _recorded(path: str, prompts: list[list[int]], overrides: list[str], torch_ops: bool):
    """Greedy outputs and the recorder's physical counts [L, P] after generating."""
    with Engine(path, overrides=BF16_CUDA + ["eplb.record_mode=stat"] + overrides) as eng:
        if torch_ops:  # the recorder's torch form instead of its one-launch kernel
            eng.runner.moe_parallel.recorder.kernel_pdl = None
        outs = eng.generate(input_ids=prompts, sampling_params={
            "temperature": 0, "max_new_tokens": 24, "ignore_eos": True})
        counts = eng.runner.moe_parallel.recorder.physical_counts().cpu()
    return [o["output_ids"] for o in outs], counts


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_graphs_record_the_expert_counts_of_eager_torch_ops(tiny_model, arch):
    """Decode graphs count experts inside the graph (kernels/triton/expert_count.py, padded rows
    excluded): the counts equal an eager run's through the recorder's torch ops (8 requests: a
    bucket size, so both runs' GEMMs see the same shapes and route alike)."""
    path = tiny_model(arch)
    prompts = prompts_of_lengths([5, 17, 9, 30, 3, 12, 21, 8], 30000, seed=7)
    eager = _recorded(path, prompts, ["cuda_graph.enabled=false"], torch_ops=True)
    graphs = _recorded(path, prompts, ["cuda_graph.enabled=true", "cuda_graph.max_bs=16",
                                       "cuda_graph.max_extend_tokens=0"], torch_ops=False)
    assert graphs[0] == eager[0]
    assert int(eager[1].sum()) > 0
    assert torch.equal(graphs[1], eager[1])


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("lengths", [[32], [5, 17, 9, 30, 3, 12, 21, 31]])  # 32 and 128 tokens
def test_extend_graphs_are_token_identical_to_eager(tiny_model, arch, lengths):
    path = tiny_model(arch)
    prompts = prompts_of_lengths(lengths, 30000, seed=5)
    common = ["cuda_graph.enabled=true", "cuda_graph.max_bs=16"]
    eager = _generate(path, prompts, common + ["cuda_graph.max_extend_tokens=0"])
    graphs = _generate(path, prompts, common + ["cuda_graph.max_extend_tokens=256"])
    assert graphs == eager


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_overlap_loop_with_deferred_tokens_equals_normal_loop(tiny_model, arch):
    """In the overlap loop the forward worker launches a step before the previous one's tokens
    reach the host (host_copy.PendingHost); the normal loop waits for every step. All requests
    run together to the same length, so the batches are the same: greedy and seeded sampled
    outputs must be identical."""
    path = tiny_model(arch)
    prompts = prompts_of_lengths([5, 17, 9, 30, 3, 12], 30000, seed=11)

    def run(overlap: bool) -> list[list[int]]:
        with Engine(path, overrides=BF16_CUDA + [f"scheduler.overlap={overlap}"]) as eng:
            greedy = eng.generate(input_ids=prompts, sampling_params={
                "temperature": 0, "max_new_tokens": 20, "ignore_eos": True})
            sampled = eng.generate(input_ids=prompts, sampling_params=[
                {"temperature": 0.8, "seed": 100 + i, "max_new_tokens": 20, "ignore_eos": True}
                for i in range(len(prompts))])
        return [o["output_ids"] for o in greedy + sampled]

    normal, overlap = run(False), run(True)
    assert all(len(o) == 20 for o in normal)
    assert overlap == normal


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_padded_extend_graph_matches_eager(tiny_model, arch):
    """37 tokens over 3 requests (one on a cached prefix) replay the 64-token graph: the logits
    match the eager forward's, and the padding writes no live slot."""
    from moeserve.core import ForwardMode

    runner = ModelRunner(compose(BF16_CUDA + ["cuda_graph.max_extend_tokens=128"]),
                         tiny_model(arch))
    g = runner.extend_graphs
    assert g is not None and 64 in g.buckets
    mem = runner.memory
    rows = mem.req_to_token.alloc(3)
    slots = mem.allocator.alloc(3 * 32).view(3, 32).cuda()
    for r, s in zip(rows, slots):
        mem.req_to_token.write(r, 0, s)
    prompts = prompts_of_lengths([10, 16, 15, 6], runner.hf_config.vocab_size, seed=7)
    runner.forward(runner.make_batch(ForwardMode.EXTEND, prompts[0], list(range(10)),
                                     slots[0, :10], rows[:1], [0], [10]))
    lens = [6, 16, 15]  # request 0 continues at 10 (a prefix hit), 1 and 2 are new
    ids = prompts[3] + prompts[1] + prompts[2]  # 37 tokens
    pos = list(range(10, 16)) + list(range(16)) + list(range(15))
    loc = torch.cat([slots[0, 10:16], slots[1, :16], slots[2, :15]])
    victim = mem.pool.key_buffer(0)[slots[2, 20]].clone()

    def step():
        return runner.make_batch(ForwardMode.EXTEND, ids, pos, loc, rows, [10, 0, 0], lens)

    assert g.bucket_of_step(step()) == 64
    with_graph = runner.forward(step())
    assert torch.equal(mem.pool.key_buffer(0)[slots[2, 20]], victim)
    saved, runner.extend_graphs = runner.extend_graphs, None
    eager = runner.forward(step())
    runner.extend_graphs = saved
    assert with_graph.shape == eager.shape == (3, runner.hf_config.vocab_size)
    assert torch.isfinite(with_graph).all()
    torch.testing.assert_close(with_graph, eager, rtol=2e-2, atol=2e-2)


def test_graph_runner_buckets_and_padding(tiny_model):
    """A batch of 3 replays the bucket of 4: its logits match the eager forward's rows, and the
    padding row writes only the sink slot, not the slot a 4th request used in the step before."""
    from moeserve.core import ForwardMode

    runner = ModelRunner(compose(BF16_CUDA + ["cuda_graph.max_bs=8"]), tiny_model("qwen3_moe"))
    g = runner.graph_runner
    assert g is not None and g.buckets == [1, 2, 4, 8] and g.bucket_for(3) == 4
    assert g.bucket_for(9) is None
    mem = runner.memory
    rows = mem.req_to_token.alloc(4)
    slots = mem.allocator.alloc(4 * 8).view(4, 8).cuda()
    for r, s in zip(rows, slots):
        mem.req_to_token.write(r, 0, s)
    prompts = prompts_of_lengths([7, 7, 7, 7], runner.hf_config.vocab_size, seed=1)
    runner.forward(runner.make_batch(ForwardMode.EXTEND, [t for p in prompts for t in p],
                                     list(range(7)) * 4, slots[:, :7].flatten(), rows, [0] * 4,
                                     [7] * 4))

    def decode(n: int):
        return runner.make_batch(ForwardMode.DECODE, [1, 2, 3, 4][:n], [7] * n, slots[:n, 7],
                                 rows[:n], [7] * n, [1] * n)

    runner.forward(decode(4))  # the 4th row's slot is now in the static buffer
    victim = mem.pool.key_buffer(0)[slots[3, 7]].clone()
    with_graph = runner.forward(decode(3))
    assert torch.equal(mem.pool.key_buffer(0)[slots[3, 7]], victim)
    saved, runner.graph_runner = runner.graph_runner, None
    eager = runner.forward(decode(3))
    runner.graph_runner = saved
    assert with_graph.shape == eager.shape == (3, runner.hf_config.vocab_size)
    assert torch.isfinite(with_graph).all()
    torch.testing.assert_close(with_graph, eager, rtol=2e-2, atol=2e-2)
