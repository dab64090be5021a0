"""The fused-MoE Triton kernels (the sorted path; the GEMV path of few pairs in
test_fused_moe_small.py) equal a float64 per-expert reference and MoEExperts.forward_loop,
including expert-parallel shards (ids outside this rank's range contribute 0). Without CUDA they
run in Triton's interpreter in float32 (exact there); on CUDA in bf16 with looser tolerances."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from moeserve.kernels.triton import fused_moe as fm
from moeserve.kernels.triton import moe_align as ma
from moeserve.kernels.triton import moe_config
from moeserve.layers.moe import MoEExperts
from moeserve.layers.moe_parallel import MoEParallel

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32
TOL = dict(rtol=3e-2, atol=3e-2) if DTYPE == torch.bfloat16 else dict(rtol=1e-4, atol=1e-5)
SMALL = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=32, GROUP_SIZE_M=4, num_warps=4,
             num_stages=2)


def _inputs(t, h, i, e_global, k, seed, first=0, num_local=None, stray=False):
    """Random x, w13, w2 for experts [first, first + num_local), distinct top-k ids over
    e_global (with `stray`: some ids made negative or >= e_global) and weights."""
    g = torch.Generator().manual_seed(seed)
    n = e_global if num_local is None else num_local
    x = torch.randn(t, h, generator=g)
    w13 = torch.randn(n, 2 * i, h, generator=g) / h**0.5
    w2 = torch.randn(n, h, i, generator=g) / i**0.5
    ids = torch.rand(t, e_global, generator=g).argsort(1)[:, :k]  # [T, K] distinct
    if stray:
        r = torch.rand(t, k, generator=g)
        ids = torch.where(r < 0.1, -1 - ids, torch.where(r > 0.9, ids + e_global, ids))
    w = torch.rand(t, k, generator=g)
    to = lambda a: a.to(DEVICE, DTYPE)  # noqa: E731
    return to(x), to(w13), to(w2), ids.to(DEVICE), w.to(DEVICE)


def _reference(x, w13, w2, ids, w, first=0):
    """float64: sum over local pairs of w * (silu(x @ gate^T) * (x @ up^T)) @ w2^T, per expert."""
    x, w13, w2, w = x.double().cpu(), w13.double().cpu(), w2.double().cpu(), w.double().cpu()
    local = (ids.cpu() - first).flatten()  # [T*K]
    out = torch.zeros(x.shape, dtype=torch.float64)
    i = w13.shape[1] // 2
    for e in range(w13.shape[0]):
        pairs = (local == e).nonzero().flatten()
        tok = pairs // ids.shape[1]
        h = F.silu(x[tok] @ w13[e, :i].T) * (x[tok] @ w13[e, i:].T)
        out.index_add_(0, tok, (h @ w2[e].T) * w.flatten()[pairs, None])
    return out


def _check(out, x, w13, w2, ids, w, first=0):
    assert out.shape == x.shape and out.dtype == x.dtype
    torch.testing.assert_close(out.double().cpu(), _reference(x, w13, w2, ids, w, first), **TOL)


class LaunchSpy:
    """Stands in for `_moe_gemm_kernel`, recording each launch's `keys` (launch kwargs, e.g.
    SWAP_AB or B_TMA) as a tuple, or the value itself for one key."""

    def __init__(self, kernel, *keys: str):
        self.kernel, self.keys, self.launches = kernel, keys, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            got = tuple(int(kwargs[k]) for k in self.keys)
            self.launches.append(got[0] if len(got) == 1 else got)
            return self.kernel[grid](*args, **kwargs)
        return launch


@pytest.fixture
def poisoned_buffers(monkeypatch):
    """Intermediate buffers start as NaN: a row the kernels forget to write or to skip shows."""
    orig = torch.Tensor.new_empty

    def new_empty(self, *args, **kwargs):
        buf = orig(self, *args, **kwargs)
        return buf.fill_(float("nan")) if buf.is_floating_point() else buf

    monkeypatch.setattr(torch.Tensor, "new_empty", new_empty)


@pytest.mark.parametrize("t,h,i,e,k", [(1, 32, 32, 8, 1), (5, 48, 40, 16, 2), (17, 64, 96, 8, 8),
                                       (9, 32, 48, 256, 8), (100, 32, 32, 16, 4)])
def test_matches_float64_reference(t, h, i, e, k, poisoned_buffers):
    x, w13, w2, ids, w = _inputs(t, h, i, e, k, seed=t + k)
    _check(fm.fused_moe(x, w13, w2, ids, w), x, w13, w2, ids, w)


@pytest.mark.parametrize("t,k", [(7, 3), (130, 8)])  # 1040 pairs: the torch align path
def test_partial_tiles_with_explicit_config(t, k, poisoned_buffers):
    x, w13, w2, ids, w = _inputs(t, 40, 24, 8, k, seed=3)  # H, I not multiples of 32
    out = fm.fused_moe(x, w13, w2, ids, w, config=SMALL, small_path=False)  # the config's path
    _check(out, x, w13, w2, ids, w)


@pytest.mark.parametrize("small_path", [None, False])  # auto (GEMV up to 32 pairs), sorted
@pytest.mark.parametrize("t,k,first,num_local", [(11, 2, 3, 5), (40, 6, 8, 4), (3, 8, 0, 16)])
def test_expert_parallel_shard(t, k, first, num_local, small_path, poisoned_buffers):
    x, w13, w2, ids, w = _inputs(t, 32, 40, 16, k, seed=k, first=first, num_local=num_local,
                                 stray=True)
    out = fm.fused_moe(x, w13, w2, ids, w, first_expert=first, num_local=num_local,
                       small_path=small_path)
    _check(out, x, w13, w2, ids, w, first)
    m = MoEExperts(16, 32, 40, first_expert=first, num_local=num_local).to(DEVICE, DTYPE)
    m.w13.data, m.w2.data = w13, w2
    torch.testing.assert_close(out, m.forward_loop(x, ids, w), **TOL)


@pytest.mark.parametrize("small_path", [None, False])
def test_no_local_pair_gives_zeros(small_path):
    x, w13, w2, ids, w = _inputs(6, 32, 32, 8, 2, seed=5, num_local=4)
    out = fm.fused_moe(x, w13, w2, ids + 100, w, num_local=4, small_path=small_path)
    assert torch.equal(out, torch.zeros_like(x))


@pytest.mark.parametrize("small_path", [None, True, False])
def test_zero_tokens(small_path):
    x, w13, w2, ids, w = _inputs(0, 32, 32, 8, 2, seed=0)
    out = fm.fused_moe(x, w13, w2, ids, w, small_path=small_path)
    assert out.shape == (0, 32) and out.dtype == DTYPE


@pytest.mark.parametrize("path", ["_align_triton", "_align_torch", "_align_parallel"])
@pytest.mark.parametrize("t,k,e,block_m,first,num_local", [
    (1, 1, 8, 16, 0, 8), (13, 3, 12, 16, 2, 6), (50, 8, 256, 16, 0, 256), (40, 2, 8, 64, 1, 5),
    (300, 8, 128, 64, 32, 64)])
def test_align_block_size_layout(path, t, k, e, block_m, first, num_local, monkeypatch):
    orig = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: orig(*a, **kw).fill_(-7))  # poison
    ids = _inputs(t, 16, 16, e, k, seed=t, stray=True)[3]
    p = ma.max_padded_pairs(ids.numel(), num_local, block_m)
    s, ex, post = getattr(ma, path)(ids, block_m, first, num_local, p)
    s, ex, post, n = s.cpu().long(), ex.cpu().long(), int(post), ids.numel()
    assert s.shape == (p,) and ex.shape == (p // block_m,) and post % block_m == 0
    local = (ids.cpu() - first).flatten()
    is_local = (local >= 0) & (local < num_local)
    real = s[s < n]
    assert torch.equal(real.sort().values, is_local.nonzero().flatten())  # each local pair once
    assert ((s >= 0) & (s <= n)).all() and (s[post:] == n).all()  # the rest is padding
    blocks = s.view(-1, block_m)
    for b, e_b in enumerate(ex.tolist()):
        assert (e_b == -1) == (b * block_m >= post)
        pairs = blocks[b][blocks[b] < n]
        assert (local[pairs] == e_b).all() and (e_b == -1 or len(pairs) > 0)
    assert sorted(set(ex[ex >= 0].tolist())) == ex[ex >= 0].tolist()  # one run per expert
    assert post == sum(-(-int((local == j).sum()) // block_m) * block_m for j in range(num_local))


@pytest.mark.parametrize("first,num_local", [(0, 16), (4, 10)])
def test_align_one_token_blocks_in_pair_order(first, num_local):
    """Batch-1 decode: block k holds pair k alone; a non-local expert's block is -1 (skipped)."""
    ids = torch.tensor([[9, 2, 15, 5]], device=DEVICE)
    s, ex, post = ma.moe_align_block_size(ids, 16, first, num_local)
    assert s.shape == (64,) and ex.shape == (4,) and int(post) == 64
    blocks = s.view(4, 16).cpu()
    assert blocks[:, 0].tolist() == [0, 1, 2, 3] and (blocks[:, 1:] == 4).all()
    want = [i - first if 0 <= i - first < num_local else -1 for i in [9, 2, 15, 5]]
    assert ex.tolist() == want
    x, w13, w2, _, w = _inputs(1, 32, 24, 16, 4, seed=3, num_local=num_local)
    out = fm.fused_moe(x, w13, w2, ids, w, first, num_local, small_path=False)  # this align
    _check(out, x, w13, w2, ids, w, first)


def test_align_paths_agree():
    ids = _inputs(97, 16, 16, 32, 5, seed=9, stray=True)[3]
    p = ma.max_padded_pairs(ids.numel(), 20, 32)
    a = ma._align_triton(ids, 32, 4, 20, p)
    b = ma._align_torch(ids, 32, 4, 20, p)
    assert all(torch.equal(u, v) for u, v in zip(a, b))
    # the parallel kernels place an expert's pairs in any order: the same runs, sorted equal
    c = ma._align_parallel(ids, 32, 4, 20, p)
    assert torch.equal(c[1], b[1]) and torch.equal(c[2], b[2])
    runs_b, runs_c = b[0].view(-1, 32), c[0].view(-1, 32)
    for e in range(20):
        mine = b[1] == e
        assert torch.equal(runs_b[mine].flatten().sort().values,
                           runs_c[mine].flatten().sort().values)


def test_fused_moe_many_pairs_equals_loop():
    """Past TRITON_ALIGN_MAX_PAIRS (the parallel align), EP-local masking."""
    x, w13, w2, ids, w = _inputs(160, 32, 24, 16, 8, seed=11, num_local=10)
    assert ids.numel() > ma.TRITON_ALIGN_MAX_PAIRS
    out = fm.fused_moe(x, w13, w2, ids, w, 3, 10, small_path=False)
    _check(out, x, w13, w2, ids, w, 3)


def test_layer_backend_triton_equals_loop():
    par = MoEParallel(moe_backend="triton", moe_config_dir="/nonexistent")
    m = par.make_experts(8, 32, 24, layer_id=0).to(DEVICE, DTYPE)
    assert m.backend == "triton" and m.config_dir == "/nonexistent"
    x, w13, w2, ids, w = _inputs(21, 32, 24, 8, 2, seed=4)
    m.w13.data, m.w2.data = w13, w2
    torch.testing.assert_close(m(x, ids, w), m.forward_loop(x, ids, w), **TOL)


def test_config_table_nearest_entry(tmp_path):
    cfg = lambda m: dict(SMALL, BLOCK_SIZE_M=m)  # noqa: E731
    name = moe_config.config_file_name(8, 32, 24, torch.float32)
    (tmp_path / name).write_text(json.dumps({"1": cfg(16), "64": cfg(32), "1024": cfg(64)}))
    def get(t):
        return moe_config.get_moe_config(8, 32, 24, 2, torch.float32, t, str(tmp_path))

    assert [get(t)["BLOCK_SIZE_M"] for t in (1, 20, 40, 500, 600, 9000)] == [16, 16, 32, 32, 64, 64]
    get(1)["BLOCK_SIZE_M"] = 999  # a copy: the cache is not mutated
    assert get(1)["BLOCK_SIZE_M"] == 16
    other = moe_config.get_moe_config(8, 32, 40, 2, torch.float32, 1, str(tmp_path))
    assert set(other) == set(moe_config.KEYS)  # no table for this shape: the heuristic


def test_down_config_retiles_the_down_gemm(tmp_path):
    """A `down` entry changes only the second GEMM's tile; results stay the reference's, and the
    table validates its keys."""
    x, w13, w2, ids, w = _inputs(37, 64, 48, 8, 2, seed=9)
    down = dict(BLOCK_SIZE_N=16, BLOCK_SIZE_K=16, GROUP_SIZE_M=1, num_warps=2, num_stages=1)
    cfg = dict(SMALL, down=down)
    assert moe_config.down_config(cfg) == dict(SMALL, **down)
    _check(fm.fused_moe(x, w13, w2, ids, w, config=cfg, small_path=False), x, w13, w2, ids, w)
    name = moe_config.config_file_name(8, 64, 48, torch.float32)
    (tmp_path / name).write_text(json.dumps({"32": cfg}))
    got = moe_config.get_moe_config(8, 64, 48, 2, torch.float32, 30, str(tmp_path))
    assert got == cfg
    got["down"]["BLOCK_SIZE_N"] = 999  # a copy, nested entries included
    assert moe_config.get_moe_config(8, 64, 48, 2, torch.float32, 30, str(tmp_path)) == cfg
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / name).write_text(json.dumps({"32": dict(SMALL, down=dict(BLOCK_SIZE_M=32))}))
    with pytest.raises(ValueError, match="unknown keys"):
        moe_config.get_moe_config(8, 64, 48, 2, torch.float32, 30, str(bad))


def test_default_config_small_blocks_for_decode():
    get = lambda t: moe_config.default_config(128, 2048, 768, 8, torch.bfloat16, t)  # noqa: E731
    assert get(1)["BLOCK_SIZE_M"] == 16 and get(8192)["BLOCK_SIZE_M"] >= 64
    assert all(set(get(t)) == set(moe_config.KEYS) for t in (1, 64, 512, 4096))


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 7, 64, 512, 4096])
@pytest.mark.parametrize("e,h,i,k", [(128, 512, 384, 8), (64, 256, 352, 6)])
def test_gpu_bf16_matches_grouped(t, e, h, i, k):
    x, w13, w2, ids, w = _inputs(t, h, i, e, k, seed=t)
    m = MoEExperts(e, h, i).to(DEVICE, DTYPE)
    m.w13.data, m.w2.data = w13, w2
    out = fm.fused_moe(x, w13, w2, ids, w)
    torch.testing.assert_close(out, m.forward_grouped(x, ids, w), **TOL)
    _check(out, x, w13, w2, ids, w)


@pytest.mark.gpu
def test_gpu_cuda_graph_replay():
    x, w13, w2, ids, w = _inputs(16, 256, 128, 32, 4, seed=1, first=8, num_local=16, stray=True)
    run = lambda: fm.fused_moe(x, w13, w2, ids, w, first_expert=8, num_local=16)  # noqa: E731
    run()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    fresh = _inputs(16, 256, 128, 32, 4, seed=2, first=8, num_local=16, stray=True)
    for static, new in zip((x, ids, w), (fresh[0], fresh[3], fresh[4])):
        static.copy_(new)
    graph.replay()
    _check(out, x, w13, w2, ids, w, first=8)
