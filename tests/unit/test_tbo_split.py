"""TBO on one process: the splitter (token balance, a cut inside a request, min_tokens votes), the
executor's interleaving order, and the model's op list with TBO forced on a single rank (no
dispatcher: the same stages, no communication) against the plain forward."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from parity import extend_batch, make_runner, prompts_of_lengths
from tbo_checks import check_forced_tbo_with_loopback, greedy_decode

from moeserve.config import TBOConfig
from moeserve.core import ForwardMode
from moeserve.tbo.operations import YIELD, ForwardState, Op, Timeline, run_interleaved, stages
from moeserve.tbo.split import micro_token_counts, plan_split, split_batch
from moeserve.tbo.strategy import NO_VOTE, VETO, WANT, decide, vote



# ---- splitter ------------------------------------------------------------------------------------
@pytest.mark.parametrize("lens,plan", [
    ([1] * 6, (3, 3, 3, 0)),  # decode: halves by sequences
    ([1] * 5, (3, 3, 3, 0)),  # odd: A takes the extra token
    ([4, 4], (4, 1, 1, 0)),  # boundary exactly at half: no cut
    ([5, 17, 9], (16, 2, 1, 11)),  # cut inside request 1: 11 of its 17 tokens in A
    ([30], (15, 1, 0, 15)),  # one long prompt: cut in the middle
    ([1], (1, 1, 1, 0)),  # one token: B empty
    ([], (0, 0, 0, 0)),  # idle: both empty
])
def test_plan_split_balances_tokens(lens, plan):
    p = plan_split(lens)
    assert (p.tokens_a, p.a_end, p.b_start, p.cut) == plan
    assert p.tokens_a == micro_token_counts(sum(lens))[0]


def _batch(runner, mode, prefix, ext):
    n = sum(ext)
    return runner.make_batch(mode, list(range(n)), list(range(n)), torch.arange(1, n + 1),
                             list(range(len(ext))), prefix, ext, global_num_tokens=[n, 7, 1, 0])


@pytest.fixture(scope="module")
def ds_runner(tiny_model):
    return make_runner(tiny_model("deepseek_v3"))


def test_split_batch_cut_request_and_counts(ds_runner):
    fb = _batch(ds_runner, ForwardMode.EXTEND, [3, 0, 2], [5, 17, 9])
    a, b = split_batch(fb)
    assert (a.num_tokens, b.num_tokens) == (16, 15)
    assert a.extend_seq_lens_cpu == [5, 11] and a.extend_prefix_lens_cpu == [3, 0]
    assert a.seq_lens_cpu == [8, 11] and a.seq_lens.tolist() == [8, 11]
    assert b.extend_seq_lens_cpu == [6, 9] and b.extend_prefix_lens_cpu == [11, 2]
    assert b.seq_lens_cpu == [17, 11] and b.req_pool_indices.tolist() == [1, 2]
    assert torch.equal(torch.cat([a.positions, b.positions]), fb.positions)
    assert torch.equal(torch.cat([a.out_cache_loc, b.out_cache_loc]), fb.out_cache_loc)
    # every rank's micro-batch sizes follow from its token count alone
    assert a.global_num_tokens == [16, 4, 1, 0] and b.global_num_tokens == [15, 3, 0, 0]
    assert a.micro_batch and b.micro_batch and not a.tbo


def test_split_decode_one_token_and_idle(ds_runner):
    a, b = split_batch(_batch(ds_runner, ForwardMode.DECODE, [4, 6, 8], [1, 1, 1]))
    assert (a.batch_size, b.batch_size, a.forward_mode, b.forward_mode) == (
        2, 1, ForwardMode.DECODE, ForwardMode.DECODE)
    a, b = split_batch(_batch(ds_runner, ForwardMode.DECODE, [4], [1]))
    assert (a.num_tokens, b.num_tokens, b.forward_mode) == (1, 0, ForwardMode.IDLE)
    a, b = split_batch(_batch(ds_runner, ForwardMode.IDLE, [], []))
    assert a.forward_mode == b.forward_mode == ForwardMode.IDLE and a.num_tokens == 0


def test_votes_and_min_tokens():
    cfg = TBOConfig(enabled=True, min_tokens=8)
    assert vote(cfg, True, ForwardMode.EXTEND, 8) == WANT
    assert vote(cfg, True, ForwardMode.DECODE, 7) == NO_VOTE  # below min_tokens
    assert vote(cfg, True, None, 0) == NO_VOTE  # nothing to run: follows the others
    assert vote(cfg, False, ForwardMode.EXTEND, 100) == NO_VOTE  # dense / ep_size=1
    assert vote(cfg, True, ForwardMode.TARGET_VERIFY, 100) == VETO
    assert decide([WANT, NO_VOTE]) and not decide([NO_VOTE, NO_VOTE])
    assert not decide([WANT, VETO])


# ---- executor ------------------------------------------------------------------------------------
def test_interleaving_order_and_timeline():
    order = []

    def op(name, layer=0):
        return Op(name, lambda s: order.append((s.name, name)), layer)

    ops = [op("attn"), op("dispatch_start"), YIELD, op("dispatch_wait"), op("experts"),
           op("combine_start"), YIELD, YIELD, op("combine_wait"), op("residual")]
    assert [len(s) for s in stages(ops)] == [2, 3, 2]
    a, b = ForwardState(None, None, name="a"), ForwardState(None, None, name="b")
    tl = Timeline()
    run_interleaved(ops, a, b, tl)
    assert order == [("a", "attn"), ("a", "dispatch_start"), ("b", "attn"),
                     ("b", "dispatch_start"), ("a", "dispatch_wait"), ("a", "experts"),
                     ("a", "combine_start"), ("b", "dispatch_wait"), ("b", "experts"),
                     ("b", "combine_start"), ("a", "combine_wait"), ("a", "residual"),
                     ("b", "combine_wait"), ("b", "residual")]
    spans = tl.comm_spans()
    assert [(s["mb"], s["kind"]) for s in spans] == [("a", "dispatch"), ("b", "dispatch"),
                                                      ("a", "combine"), ("b", "combine")]
    assert 0.0 < tl.overlap_fraction() <= 1.0  # the other micro-batch ran inside every span
    assert "dispatch_start" in tl.render()


# ---- the model's op list, TBO forced on one rank -------------------------------------------------
@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3_moe"])
def test_forced_tbo_matches_plain_forward(tiny_model, arch):
    runner = make_runner(tiny_model(arch))
    layers = runner.model.model.main_layers()
    assert any(layer.is_moe for layer in layers)
    names = [op.name for op in layers[-1].operations() if isinstance(op, Op)]
    assert names == ["attn_prepare", "attn_core", "attn_output", "router", "dispatch_start",
                     "dispatch_wait", "experts", "combine_start", "combine_wait",
                     "shared_experts", "residual"]
    prompts = prompts_of_lengths([5, 17, 9], runner.hf_config.vocab_size)
    with extend_batch(runner, prompts, return_all_logits=True) as fb:  # cuts request 1
        ref = runner.forward(fb)
        ours = runner.forward(dataclasses.replace(fb, tbo=True, attn_metadata=None))
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_decode_kept_kv_survives_micro_batches(ds_runner):
    """The torch backend keeps decode K/V across steps: TBO steps in between must not corrupt
    it (micro-batches keep nothing and the next plain step gathers afresh)."""
    prompts = prompts_of_lengths([6, 9, 4], ds_runner.hf_config.vocab_size, seed=3)
    ref = greedy_decode(ds_runner, prompts, 8, lambda i: False)
    assert greedy_decode(ds_runner, prompts, 8, lambda i: i % 3 == 1) == ref
    assert greedy_decode(ds_runner, prompts, 8, lambda i: True) == ref


# ---- the GPU kernels' paths under micro-batches --------------------------------------------------
TRITON = ["attention.backend=triton", "moe.backend=triton", "model.cpu_kernels=false"]


@pytest.mark.slow  # the interpreter: ~1 min per model on 2 cores
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter test; the GPU runs the same "
                    "check in tests/gpu/test_tbo_gpu.py")
@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3_moe"])
def test_forced_tbo_triton_paths_with_loopback(tiny_model, arch):
    """Triton attention over the paged KV and fused MoE in the interpreter, with the loopback
    dispatcher: TBO prefill (a request cut in two) and decode give the plain results."""
    runner = make_runner(tiny_model(arch), TRITON)
    assert type(runner.attn_backend).__name__ == "TritonAttentionBackend"
    check_forced_tbo_with_loopback(runner)
