"""The small-batch (GEMV) path of fused_moe equals the float64 per-expert reference, the sorted
path and MoEExperts.forward_loop, with expert-parallel masking (non-local pairs contribute 0, a
token without local pairs gets zeros); with FP8 experts (weight-only: e4m3 weights in DeepSeek's
blocks, gate and up blocked apart, activations not quantized) the float64 reference on the
dequantized weights. Without CUDA: Triton's interpreter in float32, with the interpreter's launch
geometry and, in some tests, the CUDA one; on CUDA bf16 within TOL."""

from __future__ import annotations

import pytest
import torch
import triton
from test_fused_moe import DEVICE, DTYPE, TOL, _check, _inputs, poisoned_buffers  # noqa: F401

from moeserve.kernels.triton import fused_moe as fm
from moeserve.kernels.triton import fused_moe_small as fs
from moeserve.kernels.fp8_format import dequantize_fp8_blocks, quantize_fp8_blocks
from moeserve.kernels.triton.gemv import FP8_TILE_ELEMS, MIN_BLOCK_K
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
    monkeypatch.setattr(fm, "fused_moe_small",
                        lambda *a, **kw: calls.append(a[3].numel()) or orig(*a, **kw))
    for t in (4, 5):  # 32 pairs: the GEMV path; 40: sorted
        x, w13, w2, ids, w = _inputs(t, 32, 32, 16, 8, seed=t)
        _check(fm.fused_moe(x, w13, w2, ids, w), x, w13, w2, ids, w)
    assert calls == [fs.SMALL_MAX_PAIRS]


def _fp8_experts(w13, w2, block=(128, 128)):
    """Each expert's gate, up and down quantized on its own (as checkpoints store them):
    (w13_q, w13_scale [E, 2 * ceil(I/bn), ceil(H/bk)], w2_q, w2_scale, dequantized w13, w2)."""
    i = w13.shape[1] // 2
    parts = [[quantize_fp8_blocks(p, block) for p in (e[:i], e[i:])] for e in w13]
    downs = [quantize_fp8_blocks(e, block) for e in w2]
    deq = lambda q, s: dequantize_fp8_blocks(q, s, block)  # noqa: E731
    w13_q = torch.stack([torch.cat([q for q, _ in p]) for p in parts])
    w13_s = torch.stack([torch.cat([s for _, s in p]) for p in parts])
    w13_d = torch.stack([torch.cat([deq(q, s) for q, s in p]) for p in parts])
    w2_q, w2_s = torch.stack([q for q, _ in downs]), torch.stack([s for _, s in downs])
    return w13_q, w13_s, w2_q, w2_s, w13_d, torch.stack([deq(q, s) for q, s in downs])


@pytest.mark.parametrize("t,h,i,e,k,block", [
    (1, 200, 72, 8, 1, (128, 128)), (1, 300, 136, 32, 8, (128, 128)),
    (2, 130, 200, 16, 3, (128, 128)), (3, 200, 72, 64, 5, (128, 128)),
    (4, 256, 128, 16, 8, (128, 128)), (2, 96, 40, 8, 2, (16, 32))])
def test_fp8_small_path_matches_float64_on_dequantized_weights(t, h, i, e, k, block,
                                                               poisoned_buffers):  # noqa: F811
    """Partial blocks (gate's last one apart from up's first), top-k 1..8, other block sizes;
    auto choice (<= SMALL_MAX_PAIRS pairs) and small_path=True agree."""
    x, w13, w2, ids, w = _inputs(t, h, i, e, k, seed=10 * t + k)
    w13_q, w13_s, w2_q, w2_s, w13_d, w2_d = _fp8_experts(w13, w2, block)
    assert w13_s.shape[1] == 2 * -(-i // block[0])
    out = fm.fused_moe(x, w13_q, w2_q, ids, w, w13_scale=w13_s, w2_scale=w2_s, block=block)
    _check(out, x, w13_d, w2_d, ids, w)
    torch.testing.assert_close(out, fm.fused_moe(x, w13_q, w2_q, ids, w, w13_scale=w13_s,
                                                 w2_scale=w2_s, block=block, small_path=True))


@pytest.mark.parametrize("t,k,first,num_local", [(3, 4, 4, 6), (4, 8, 8, 5), (1, 8, 3, 9)])
def test_fp8_small_path_expert_parallel(t, k, first, num_local, poisoned_buffers):  # noqa: F811
    """Ids outside [first, first + num_local) (strays < 0 and >= E too) contribute 0; token 1
    of the multi-token cases has no local pair and gets exact zeros."""
    x, w13, w2, ids, w = _inputs(t, 200, 72, 16, k, seed=k, first=first, num_local=num_local,
                                 stray=True)
    if t > 1:
        ids[1] = torch.tensor([j for j in range(-2, 24) if not first <= j < first + num_local][:k])
    w13_q, w13_s, w2_q, w2_s, w13_d, w2_d = _fp8_experts(w13, w2)
    out = fm.fused_moe(x, w13_q, w2_q, ids, w, first, num_local, w13_scale=w13_s, w2_scale=w2_s)
    _check(out, x, w13_d, w2_d, ids, w, first)
    if t > 1:
        assert torch.equal(out[1], torch.zeros_like(out[1]))


def test_fp8_cuda_launch_geometry_in_interpreter():
    """The CUDA configs for 128 and 16-row blocks run and match: block_n divides bn, K steps
    over several scale columns and a partial one."""
    x, w13, w2, ids, w = _inputs(2, 300, 136, 8, 4, seed=3)
    for block in ((128, 128), (16, 32)):
        w13_q, w13_s, w2_q, w2_s, w13_d, w2_d = _fp8_experts(w13, w2, block)
        cfg = fs.small_moe_config(2, 4, 300, 136, CUDA, block)
        assert block[0] % cfg.gate_up.block_n == 0 and block[0] % cfg.down.block_n == 0
        out = fs.fused_moe_small(x, w13_q, w2_q, ids, w, 0, 8, cfg, w13_s, w2_s, block)
        _check(out, x, w13_d, w2_d, ids, w)


@pytest.mark.parametrize("t,e,h,i,k", [(1, 256, 7168, 2048, 8), (4, 256, 7168, 2048, 8),
                                       (1, 64, 2048, 1408, 6)])
def test_fp8_cuda_geometry(t, e, h, i, k):
    """DeepSeek-V3 / V2-Lite decode with 128 x 128 blocks: programs inside one scale row and
    steps inside one scale column, as many programs as the bf16 path aims at, gate_up steps of
    at most the 16-bit path's bytes (DeepSeek-V3's: exactly), down steps of at most its
    elements."""
    gu, dn = fs.small_moe_config(t, k, h, i, CUDA, (128, 128))
    assert 128 % gu.block_n == 0 and 128 % dn.block_n == 0 and dn.block_n <= 8  # as bf16
    assert gu.block_k == dn.block_k == 128
    assert t * k * -(-i // gu.block_n) >= 512 and t * -(-h // dn.block_n) >= fs.DOWN_PROGRAMS
    assert 2 * gu.block_n * gu.block_k <= FP8_TILE_ELEMS
    if h == 7168:  # V3: enough pairs for whole 16-bit-sized steps
        assert 2 * gu.block_n * gu.block_k == FP8_TILE_ELEMS
    assert triton.next_power_of_2(k) * dn.block_n * dn.block_k <= fs.DOWN_TILE_ELEMS


@pytest.mark.parametrize("gu,dn", [(fs.GemvConfig(16, 64), fs.GemvConfig(8, 128)),
                                   (fs.GemvConfig(32, 128, 8), fs.GemvConfig(4, 32))])
def test_fp8_short_steps_and_other_tiles(gu, dn):
    """Steps shorter than a scale column and other tiles, over whole (H = 256, I = 128) and
    partial (H = 300, I = 136) steps."""
    for h, i in ((256, 128), (300, 136)):
        x, w13, w2, ids, w = _inputs(2, h, i, 16, 4, seed=h)
        w13_q, w13_s, w2_q, w2_s, w13_d, w2_d = _fp8_experts(w13, w2)
        out = fs.fused_moe_small(x, w13_q, w2_q, ids, w, 0, 16, fs.SmallMoeConfig(gu, dn),
                                 w13_s, w2_s)
        _check(out, x, w13_d, w2_d, ids, w)


def test_fp8_auto_choice_and_forced_sorted_path(monkeypatch):
    """FP8 at <= SMALL_MAX_PAIRS pairs: the GEMV path (activations as they are); above it, or
    with small_path=False, the sorted one (activations quantized: a different result)."""
    calls = []
    orig = fm.fused_moe_small
    monkeypatch.setattr(fm, "fused_moe_small",
                        lambda *a, **kw: calls.append(a[3].numel()) or orig(*a, **kw))
    for t in (4, 5):
        x, w13, w2, ids, w = _inputs(t, 32, 32, 16, 8, seed=t)
        w13_q, w13_s, w2_q, w2_s, w13_d, w2_d = _fp8_experts(w13, w2)
        out = fm.fused_moe(x, w13_q, w2_q, ids, w, w13_scale=w13_s, w2_scale=w2_s)
        if t == 4:
            _check(out, x, w13_d, w2_d, ids, w)
    assert calls == [fs.SMALL_MAX_PAIRS]
    x, w13, w2, ids, w = _inputs(1, 200, 72, 8, 2, seed=1)
    w13_q, w13_s, w2_q, w2_s, _, _ = _fp8_experts(w13, w2)
    args = (x, w13_q, w2_q, ids, w)
    sorted_out = fm.fused_moe(*args, w13_scale=w13_s, w2_scale=w2_s, small_path=False)
    assert len(calls) == 1
    small = fm.fused_moe(*args, w13_scale=w13_s, w2_scale=w2_s)
    err = float((sorted_out - small).norm() / small.norm())
    assert 1e-4 < err < 0.1  # e4m3 activations on the sorted path only


def test_fp8_small_path_refuses_mismatched_scales():
    x, w13, w2, ids, w = _inputs(1, 200, 72, 4, 2, seed=0)
    w13_q, w13_s, w2_q, w2_s, _, _ = _fp8_experts(w13, w2)
    for bad in (dict(w13_scale=w13_s[:, :1], w2_scale=w2_s),  # up's rows missing
                dict(w13_scale=w13_s, w2_scale=None),
                dict(w13_scale=w13_s, w2_scale=w2_s, block=(64, 128))):
        with pytest.raises(ValueError, match="scale"):
            fm.fused_moe(x, w13_q, w2_q, ids, w, small_path=True, **bad)
    with pytest.raises(ValueError, match="experts"):
        fm.fused_moe(x, w13, w2, ids, w, w13_scale=w13_s, w2_scale=w2_s, small_path=True)
    for cfg in (fs.SmallMoeConfig(fs.GemvConfig(256, 128), fs.GemvConfig(1, 128)),
                fs.SmallMoeConfig(fs.GemvConfig(16, 128), fs.GemvConfig(1, 256))):
        with pytest.raises(ValueError, match="divide"):
            fs.fused_moe_small(x, w13_q, w2_q, ids, w, 0, 4, cfg, w13_s, w2_s)


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


def _fp8_experts_cuda(e: int, h: int, i: int, seed: int):
    """Random FP8 experts made on the GPU (DeepSeek-V3 sizes are slow to draw on the CPU)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    w13 = torch.randn(e, 2 * i, h, generator=g, device="cuda") / h**0.5
    w2 = torch.randn(e, h, i, generator=g, device="cuda") / i**0.5
    return _fp8_experts(w13, w2)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 4])
@pytest.mark.parametrize("e,h,i,k", [(8, 7168, 2048, 8), (32, 2048, 768, 8), (16, 520, 136, 4)])
def test_gpu_fp8_bf16_activations_match_float64(t, e, h, i, k):
    """bf16 x on e4m3 experts (DeepSeek-V3's H and I, ragged ones), EP-local ids with strays:
    float64 on the dequantized weights; a CUDA graph replays it on new inputs."""
    w13_q, w13_s, w2_q, w2_s, w13_d, w2_d = _fp8_experts_cuda(e, h, i, seed=t)
    x, _, _, ids, w = _inputs(t, h, 8, 2 * e, k, seed=t, first=4, num_local=e, stray=True)
    run = lambda: fm.fused_moe(x, w13_q, w2_q, ids, w, 4, e, w13_scale=w13_s,  # noqa: E731
                               w2_scale=w2_s)
    out = run()
    assert out.dtype == torch.bfloat16
    _check(out, x, w13_d, w2_d, ids, w, first=4)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = run()
    fresh = _inputs(t, h, 8, 2 * e, k, seed=t + 7, first=4, num_local=e, stray=True)
    for static, new in zip((x, ids, w), (fresh[0], fresh[3], fresh[4])):
        static.copy_(new)
    graph.replay()
    _check(replayed, x, w13_d, w2_d, ids, w, first=4)
