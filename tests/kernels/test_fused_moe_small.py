"""The small-batch (GEMV) path of fused_moe equals the float64 per-expert reference, the sorted
path and MoEExperts.forward_loop, with expert-parallel masking (non-local pairs contribute 0, a
token without local pairs gets zeros). Without CUDA: Triton's interpreter in float32, with the
interpreter's launch geometry and, in one test, the CUDA one; on CUDA bf16 within TOL."""

from __future__ import annotations

import pytest
import torch
import triton
from test_fused_moe import DEVICE, DTYPE, TOL, _check, _inputs, poisoned_buffers  # noqa: F401

from moeserve.kernels import fused_moe as fm
from moeserve.kernels import fused_moe_small as fs
from moeserve.kernels.gemv import MIN_BLOCK_K
from moeserve.layers.moe import MoEExperts

CUDA = torch.device("cuda")


@pytest.mark.parametrize("t,h,i,e,k", [
    (1, 64, 96, 8, 1), (1, 130, 130, 128, 8), (2, 130, 64, 16, 3), (2, 96, 96, 256, 7),
    (3, 96, 130, 64, 5), (3, 64, 64, 16, 2), (4, 64, 96, 256, 8), (4, 130, 64, 32, 6)])
def test_small_path_matches_reference_and_sorted(t, h, i, e, k, poisoned_buffers):  # noqa: F811
    x, w13, w2, ids, w = _inputs(t, h, i, e, k, seed=10 * t + k)
    out = fm.fused_moe(x, w13, w2, ids, w, small_path=True)
    _check(out, x, w13, w2, ids, w)
    torch.testing.assert_close(out, fm.fused_moe(x, w13, w2, ids, w, small_path=False), **TOL)


@pytest.mark.parametrize("t,k,first,num_local", [(3, 4, 4, 6), (4, 8, 8, 5), (1, 8, 3, 9)])
def test_small_path_expert_parallel(t, k, first, num_local, poisoned_buffers):  # noqa: F811
    """Ids outside [first, first + num_local), stray ones (< 0, >= E) too; in the multi-token
    cases token 1 has no local pair at all, and its row is exactly zero."""
    x, w13, w2, ids, w = _inputs(t, 64, 96, 16, k, seed=k, first=first, num_local=num_local,
                                 stray=True)
    if t > 1:  # token 1: non-local ids only (other ranks' experts and strays)
        ids[1] = torch.tensor([j for j in range(-2, 24) if not first <= j < first + num_local][:k])
    out = fm.fused_moe(x, w13, w2, ids, w, first, num_local, small_path=True)
    _check(out, x, w13, w2, ids, w, first)
    m = MoEExperts(16, 64, 96, first_expert=first, num_local=num_local).to(DEVICE, DTYPE)
    m.w13.data, m.w2.data = w13, w2
    torch.testing.assert_close(out, m.forward_loop(x, ids, w), **TOL)
    if t > 1:
        local = (ids[1] - first >= 0) & (ids[1] - first < num_local)
        assert not local.any() and torch.equal(out[1], torch.zeros_like(out[1]))


def test_routing_weights_scale_the_output():
    x, w13, w2, ids, w = _inputs(2, 64, 64, 8, 3, seed=1)
    one = fm.fused_moe(x, w13, w2, ids, w, small_path=True)
    torch.testing.assert_close(fm.fused_moe(x, w13, w2, ids, 2 * w, small_path=True), 2 * one)
    w[:, 1:] = 0  # only each token's first choice counts
    ref = fm.fused_moe(x, w13, w2, ids[:, :1].contiguous(), w[:, :1].contiguous(),
                       small_path=True)
    torch.testing.assert_close(fm.fused_moe(x, w13, w2, ids, w, small_path=True), ref, **TOL)


def test_cuda_launch_geometry_in_interpreter():
    """The launch config picked on CUDA (one row per program here, K steps of 128+) runs and
    matches: partial K steps (H = 40 < 128) and I = 24 rows."""
    x, w13, w2, ids, w = _inputs(1, 40, 24, 8, 2, seed=2)
    cfg = fs.small_moe_config(1, 2, 40, 24, CUDA)
    _check(fs.fused_moe_small(x, w13, w2, ids, w, 0, 8, cfg), x, w13, w2, ids, w)


@pytest.mark.parametrize("t,e,h,i,k", [(1, 128, 2048, 768, 8), (4, 128, 2048, 768, 8),
                                       (1, 64, 2048, 1408, 6), (5, 64, 2048, 1408, 6)])
def test_cuda_geometry_fills_the_gpu(t, e, h, i, k):
    """Qwen3-30B-A3B and DeepSeek-V2-Lite decode: several hundred programs per kernel, and K
    steps of at least 128 elements (16-byte loads along the contiguous dimension)."""
    gu, dn = fs.small_moe_config(t, k, h, i, CUDA)
    assert t * k * -(-i // gu.block_n) >= 512 and t * -(-h // dn.block_n) >= fs.DOWN_PROGRAMS
    assert min(gu.block_k, dn.block_k) >= MIN_BLOCK_K
    assert triton.next_power_of_2(k) * dn.block_n * dn.block_k <= fs.DOWN_TILE_ELEMS


def test_auto_choice_by_pair_count(monkeypatch):
    calls = []
    orig = fm.fused_moe_small
    monkeypatch.setattr(fm, "fused_moe_small", lambda *a: calls.append(a[3].numel()) or orig(*a))
    for t in (4, 5):  # 32 pairs: the GEMV path; 40: sorted
        x, w13, w2, ids, w = _inputs(t, 32, 32, 16, 8, seed=t)
        _check(fm.fused_moe(x, w13, w2, ids, w), x, w13, w2, ids, w)
    assert calls == [fs.SMALL_MAX_PAIRS]


def test_small_path_refuses_fp8():
    x, w13, w2, ids, w = _inputs(1, 32, 32, 8, 2, seed=0)
    with pytest.raises(ValueError, match="FP8"):
        fm.fused_moe(x, w13, w2, ids, w, w13_scale=torch.ones(1), small_path=True)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 2, 4])
@pytest.mark.parametrize("e,h,i,k", [(128, 2048, 768, 8), (64, 2048, 1408, 6), (16, 520, 136, 4)])
def test_gpu_bf16_small_matches_sorted(t, e, h, i, k):
    x, w13, w2, ids, w = _inputs(t, h, i, e, k, seed=t)
    out = fm.fused_moe(x, w13, w2, ids, w, small_path=True)
    torch.testing.assert_close(out, fm.fused_moe(x, w13, w2, ids, w, small_path=False), **TOL)
    _check(out, x, w13, w2, ids, w)


@pytest.mark.gpu
def test_gpu_small_path_cuda_graph_replay():
    args = dict(first=8, num_local=16, stray=True)
    x, w13, w2, ids, w = _inputs(3, 256, 136, 32, 8, seed=1, **args)
    run = lambda: fm.fused_moe(x, w13, w2, ids, w, first_expert=8, num_local=16)  # noqa: E731
    run()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    fresh = _inputs(3, 256, 136, 32, 8, seed=2, **args)
    for static, new in zip((x, ids, w), (fresh[0], fresh[3], fresh[4])):
        static.copy_(new)
    graph.replay()
    _check(out, x, w13, w2, ids, w, first=8)
