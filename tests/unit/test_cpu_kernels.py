"""The C decode kernels (kernels/cpu/decode.c) against transformers' modules and float64 math, and
the torch ops they replace (where the kernel promises the same rounding, bit for bit)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from moeserve.env import FAST_PATH_FLAGS
from moeserve.kernels.cpu.build import AVX2, NATIVE, _x86_tiers, build_and_probe, load_cpu_kernels
from moeserve.layers.moe import MoEExperts
from moeserve.layers.norm import RMSNorm, rms_norm_heads
from moeserve.layers.rotary import RotaryEmbedding
from moeserve.layers.router import RouterConfig, select_experts

BF16, F32 = torch.bfloat16, torch.float32


# Every build the loader may pick: -march=native, AVX2 + FMA (x86-64), the portable fallback, and
# clang's (the tests below run on each, so the fallback builds are checked on any machine).
pytestmark = pytest.mark.usefixtures("fast_paths_unforced")
BUILDS = {"gcc-native": ("gcc", NATIVE), "gcc-avx2": ("gcc", AVX2), "gcc-portable": ("gcc", []),
          "clang-native": ("clang", NATIVE), "clang-portable": ("clang", [])}


def _compiler(cc: str) -> str | None:
    """`cc`'s path; for gcc the default compiler's (`cc`, as the loader runs it) where that is
    the same binary, so these builds are the ones the session's other modules load (one build
    each in the session's kernel cache)."""
    found = shutil.which(cc)
    default = shutil.which("cc")
    if cc == "gcc" and default and (found is None or os.path.realpath(found) ==
                                    os.path.realpath(default)):
        return default
    return found


@pytest.fixture(scope="module", params=list(BUILDS))
def kernels(request, kernel_cache):
    cc, arch = BUILDS[request.param]
    if arch == AVX2 and not _x86_tiers():
        pytest.skip("the AVX2 build is tried on x86-64 only")
    compiler = _compiler(cc)
    if compiler is None:
        pytest.skip(f"no {cc} here")
    with pytest.MonkeyPatch.context() as mp:  # the kernels under test, whatever the run forces off
        for var in FAST_PATH_FLAGS:
            mp.delenv(var, raising=False)
        k = build_and_probe(kernel_cache, [compiler], arch)
        if k is None and arch:
            pytest.skip(f"{request.param}: the build failed its probe on this CPU "
                        "(fallback tested)")
        assert k is not None, f"the portable {cc} build must build and pass its probe"
        yield k


def assert_bf16_same_rounding(a: torch.Tensor, b: torch.Tensor,
                              atol: torch.Tensor | float = 0.0) -> None:
    """Bit for bit, but for the rare value one bf16 step away: a float32 sum of squares adds in
    the order of the build's vector width (SSE, AVX-512) and torch's in its own, and a last-bit
    difference there can flip a bf16 rounding (seen once in 1344 values with clang's SSE build).
    `atol`: float32 sum-order noise where a sum cancels to near zero (a dot product's terms)."""
    diff = a.float() != b.float()
    ulp = torch.maximum(b.float().abs() * 2.0**-7, torch.as_tensor(atol, dtype=torch.float32))
    assert bool(((a.float() - b.float()).abs() <= ulp)[diff].all()), "more than one bf16 step"
    assert int(diff.sum()) <= max(1, diff.numel() // 200), f"{int(diff.sum())} values differ"


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_transformers(kernels, dtype, with_residual):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = _gen()
    ref = LlamaRMSNorm(72, eps=1e-6).to(dtype)
    ref.weight.data = torch.randn(72, generator=g).to(dtype)
    base = torch.randn(11, 80, generator=g).to(dtype)
    x = base[:, 3:75]  # strided rows
    res = torch.randn(11, 72, generator=g).to(dtype) if with_residual else None
    got = kernels.rms_norm(x, ref.weight.data, 1e-6, res)
    summed = x + res if with_residual else x
    expect = ref(summed)
    out = got[0] if with_residual else got
    if with_residual:
        assert torch.equal(got[1], summed)  # the residual stream, rounded as torch adds
    tol = 1e-6 if dtype == F32 else 1e-2
    torch.testing.assert_close(out.float(), expect.float(), rtol=tol, atol=tol)
    # and the torch path it replaces, which rounds at the same points
    ours = RMSNorm(72, eps=1e-6).to(dtype)
    ours.weight.data = ref.weight.data.clone()
    torch_out = ours(summed.contiguous())
    if dtype == BF16:
        assert_bf16_same_rounding(out, torch_out)
    else:
        torch.testing.assert_close(out, torch_out, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_qk_norm_rope_matches_transformers(kernels, dtype):
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb

    t, h, hkv, d = 7, 4, 2, 32
    g = _gen(1)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, d, 2).float() / d))
    rope = RotaryEmbedding(inv_freq, 1.0, 64)
    q_norm, k_norm = Qwen3RMSNorm(d).to(dtype), Qwen3RMSNorm(d).to(dtype)
    q_norm.weight.data = torch.randn(d, generator=g).to(dtype)
    k_norm.weight.data = torch.randn(d, generator=g).to(dtype)
    qkv = torch.randn(t, (h + 2 * hkv) * d, generator=g).to(dtype)
    positions = torch.tensor([0, 5, 63, 17, 1, 40, 2])
    out = qkv.clone()
    kernels.qk_norm_rope(out, h, hkv, d, positions, rope.cos_sin_cache, d, q_norm.weight,
                         k_norm.weight, 1e-6)
    # transformers: norm per head, then rope with cos/sin of [freqs | freqs] (in fp32 here)
    freqs = torch.outer(positions.float(), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    q = q_norm(qkv[:, : h * d].view(t, h, d)).float()
    k = k_norm(qkv[:, h * d : (h + hkv) * d].view(t, hkv, d)).float()
    q_ref, k_ref = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                        emb.cos()[None], emb.sin()[None])
    tol = 1e-5 if dtype == F32 else 2e-2
    got_q = out[:, : h * d].view(t, h, d).float()
    got_k = out[:, h * d : (h + hkv) * d].view(t, hkv, d).float()
    torch.testing.assert_close(got_q, q_ref[0].transpose(0, 1), rtol=tol, atol=tol)
    torch.testing.assert_close(got_k, k_ref[0].transpose(0, 1), rtol=tol, atol=tol)
    assert torch.equal(out[:, (h + hkv) * d :], qkv[:, (h + hkv) * d :])  # v untouched
    # the torch ops it replaces: bit for bit in bf16 (float32 sums may associate differently)
    qk = qkv[:, : (h + hkv) * d].view(t, h + hkv, d)
    ours = rope.rotate(positions, rms_norm_heads(qk, [(h, _norm(q_norm)), (hkv, _norm(k_norm))]))
    got = out[:, : (h + hkv) * d].view(t, h + hkv, d)
    if dtype == BF16:
        assert_bf16_same_rounding(got, ours)
    else:
        torch.testing.assert_close(got, ours, rtol=1e-6, atol=1e-6)


def _norm(hf_norm) -> RMSNorm:
    n = RMSNorm(hf_norm.weight.shape[0], hf_norm.variance_epsilon).to(hf_norm.weight.dtype)
    n.weight.data = hf_norm.weight.data.clone()
    return n


def test_partial_rope_without_norm_matches_torch_path(kernels):
    t, h, hkv, d, rot = 5, 3, 1, 24, 8  # rope on the first 8 channels only; head_dim % 8 != 0
    inv_freq = 1.0 / (1e4 ** (torch.arange(0, rot, 2).float() / rot))
    rope = RotaryEmbedding(inv_freq, 1.0, 32)
    qkv = torch.randn(t, (h + 2 * hkv) * d, generator=_gen(2))
    positions = torch.tensor([3, 0, 31, 7, 9])
    out = qkv.clone()
    kernels.qk_norm_rope(out, h, hkv, d, positions, rope.cos_sin_cache, rot, None, None, 0.0)
    ref = rope.rotate(positions, qkv[:, : (h + hkv) * d].view(t, h + hkv, d))
    torch.testing.assert_close(out[:, : (h + hkv) * d].view(t, h + hkv, d), ref, rtol=1e-6,
                               atol=1e-6)


def test_position_beyond_rope_table_raises(kernels):
    rope = RotaryEmbedding(1.0 / (1e4 ** (torch.arange(0, 8, 2).float() / 8)), 1.0, 16)
    qkv = torch.randn(2, 3 * 8)
    before = qkv.clone()
    with pytest.raises(IndexError, match="position 16"):
        kernels.qk_norm_rope(qkv, 1, 1, 8, torch.tensor([2, 16]), rope.cos_sin_cache, 8, None,
                             None, 0.0)
    assert torch.equal(qkv, before)  # nothing written


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("h,hkv,d", [(4, 2, 32), (9, 3, 64), (6, 6, 12)])
@pytest.mark.parametrize("lens", [[1, 7, 8, 9, 23, 70], [70]], ids=["batch6", "batch1"])
def test_decode_attention_matches_float64(kernels, dtype, h, hkv, d, lens):
    """Lengths below, at and past multiples of 8 (the kernel's block), GQA groups of 1-3, a head
    size that is not a multiple of 8 (the scalar path); slots scattered through the pool. One
    thread and two give the same bits (work is shared out by request and KV group, or by single
    heads when those are few, as at batch 1)."""
    g = _gen(3)
    b, slots = len(lens), 512
    table = torch.zeros(8, 128, dtype=torch.int64)
    rows = torch.tensor([5, 0, 7, 2, 3, 6][:b])
    perm = torch.randperm(slots - 1, generator=g) + 1
    used = 0
    for r, n in zip(rows.tolist(), lens):
        table[r, :n] = perm[used : used + n]
        used += n
    k_buf = torch.randn(slots, hkv, d, generator=g).to(dtype)
    v_buf = torch.randn(slots, hkv, d, generator=g).to(dtype)
    qkv = torch.randn(b, (h + 2 * hkv) * d, generator=g).to(dtype)
    q = qkv[:, : h * d].view(b, h, d)
    k = qkv[:, h * d : (h + hkv) * d].view(b, hkv, d)
    v = qkv[:, (h + hkv) * d :].view(b, hkv, d)
    seq_lens = torch.tensor(lens)
    loc = table[rows, seq_lens - 1]  # the new token's slot: the last position
    outs, old = [], torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs.append(kernels.decode_attention(q, k, v, loc, k_buf, v_buf, table, rows,
                                                 seq_lens, d**-0.5))
    finally:
        torch.set_num_threads(old)
    out = outs[0]
    assert torch.equal(outs[1], out)
    assert torch.equal(k_buf[loc], k) and torch.equal(v_buf[loc], v)
    for i, (r, n) in enumerate(zip(rows.tolist(), lens)):
        idx = table[r, :n]
        kk = k_buf[idx].double().repeat_interleave(h // hkv, dim=1)  # [S, H, D]
        vv = v_buf[idx].double().repeat_interleave(h // hkv, dim=1)
        w = (torch.einsum("hd,shd->hs", q[i].double(), kk) * d**-0.5).softmax(-1)
        ref = torch.einsum("hs,shd->hd", w, vv)
        tol = 1e-5 if dtype == F32 else 2e-2
        torch.testing.assert_close(out[i].double(), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("h,hkv,d", [(9, 3, 64), (4, 2, 32), (8, 2, 128), (6, 6, 12)])
def test_decode_attention_shared_runs_equal_rows_alone(kernels, dtype, h, hkv, d):
    """A verify pass's layout: runs of rows of one request, either the request's own row at
    lengths L+1..L+W (a chain) or copies of its prefix with different tails (tree nodes' scratch
    rows); with `share` the run's common prefix is read once, and the output is bit for bit the
    row-by-row one (1 and 2 threads), K/V of the batch stored first; d = 12 takes the row path."""
    g = _gen(4)
    slots = 1024
    table = torch.zeros(16, 160, dtype=torch.int64)
    perm = torch.randperm(slots - 1, generator=g) + 1
    rows, lens, share, used, scratch = [], [], [], 0, 8
    for req, (prefix, width, tree) in enumerate([(70, 4, False), (5, 3, True), (17, 1, False),
                                                 (64, 6, True), (9, 2, False)]):
        table[req, :prefix + 1] = perm[used: used + prefix + 1]
        used += prefix + 1
        for j in range(width):
            row = req
            if tree and j:  # a scratch row: the prefix and x_L, then its own tail of j slots
                row, scratch = scratch, scratch + 1
                table[row, :prefix + 1] = table[req, :prefix + 1]
            if j and (tree or j == width - 1):  # a chain's row gets its drafts' slots once
                n = j if tree else width - 1
                table[row, prefix + 1: prefix + 1 + n] = perm[used: used + n]
                used += n
            rows.append(row)
            lens.append(prefix + 1 + j)
            share.append(prefix + 1 if j else 0)
    b = len(rows)
    rows, seq_lens, share = torch.tensor(rows), torch.tensor(lens), torch.tensor(share)
    loc = table[rows, seq_lens - 1]
    assert len(set(loc.tolist())) == b and int(loc.min()) > 0  # each new token its own slot
    k_buf = torch.randn(slots, hkv, d, generator=g).to(dtype)
    v_buf = torch.randn(slots, hkv, d, generator=g).to(dtype)
    q = torch.randn(b, h, d, generator=g).to(dtype)
    k = torch.randn(b, hkv, d, generator=g).to(dtype)
    v = torch.randn(b, hkv, d, generator=g).to(dtype)
    outs, old = [], torch.get_num_threads()
    try:
        for threads, sh in ((1, None), (1, share), (2, share)):
            torch.set_num_threads(threads)
            outs.append(kernels.decode_attention(q, k, v, loc, k_buf.clone(), v_buf.clone(),
                                                 table, rows, seq_lens, d**-0.5, share=sh))
    finally:
        torch.set_num_threads(old)
    assert torch.equal(outs[1], outs[0]) and torch.equal(outs[2], outs[0])


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("renormalize", [True, False])
def test_topk_softmax_matches_torch(kernels, dtype, renormalize):
    logits = torch.randn(13, 24, generator=_gen(4)).to(dtype)
    weights, ids = kernels.topk_softmax(logits, 3, renormalize)
    probs = logits.float().softmax(-1)
    top = probs.topk(3, dim=-1)
    assert torch.equal(ids, top.indices)  # no ties in random logits; sorted descending
    expect = top.values / top.values.sum(-1, keepdim=True) if renormalize else top.values
    torch.testing.assert_close(weights, expect, rtol=1e-6, atol=1e-6)
    cfg = RouterConfig(top_k=3, renormalize=renormalize)
    w2, ids2 = select_experts(logits, cfg, kernels=kernels)  # the router's kernel path
    assert torch.equal(ids2, ids) and torch.equal(w2, weights)


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("first,num_local", [(0, 8), (3, 4)])
def test_moe_experts_match_float64(kernels, dtype, first, num_local):
    """Top-2 of 8 experts, this rank holding [first, first + num_local): the others contribute 0.
    bf16 rounds where the torch dense path rounds, so the two agree bit for bit."""
    g = _gen(5)
    hidden, inter, t, k = 64, 24, 9, 2
    experts = MoEExperts(8, hidden, inter, first_expert=first, num_local=num_local).to(dtype)
    experts.w13.data = (torch.randn(num_local, 2 * inter, hidden, generator=g) * 0.2).to(dtype)
    experts.w2.data = (torch.randn(num_local, hidden, inter, generator=g) * 0.2).to(dtype)
    x = torch.randn(t, hidden, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(8, generator=g)[:k] for _ in range(t)])
    w = torch.rand(t, k, generator=g)
    out = kernels.moe_experts(x, ids, w, experts.w13.data, experts.w2.data, first)
    ref = torch.zeros(t, hidden, dtype=torch.float64)
    for i in range(t):
        for j in range(k):
            e = int(ids[i, j]) - first
            if 0 <= e < num_local:
                gate_up = experts.w13[e].double() @ x[i].double()
                act = F.silu(gate_up[:inter]) * gate_up[inter:]
                ref[i] += w[i, j] * (experts.w2[e].double() @ act)
    tol = 1e-5 if dtype == F32 else 3e-2
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    dense = experts.forward_dense(x, ids, w)
    if dtype == BF16:
        assert torch.equal(out, dense)
    else:
        torch.testing.assert_close(out, dense, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens", [1, 3, 16, 17, 40])
def test_greedy_head_is_argmax_of_bf16_logits(kernels, tokens):
    if not kernels.has_bf16_dot:
        pytest.skip("this CPU has no AVX512-BF16: the greedy head is not built")
    g = _gen(6)
    vocab, hidden = 1003, 64  # not a multiple of 16: the last block is padded
    w = (torch.randn(vocab, hidden, generator=g) * 0.1).to(BF16)
    w[900] = w[17]  # an exact tie: the lower id wins, as in torch.argmax
    w[17] *= 4
    w[900] *= 4
    x = torch.randn(tokens, hidden, generator=g).to(BF16)
    x[0] = w[17].float().sign().to(BF16)  # token 0 peaks on the tied rows 17 and 900
    packed = kernels.pack_greedy_head(w)
    ids = kernels.greedy_head(x, packed, vocab)
    logits = F.linear(x, w)  # torch's bf16 logits
    assert ids[0] == 17 and logits[0, 17] == logits[0, 900] == logits[0].max()
    assert torch.equal(logits.gather(1, ids[:, None])[:, 0], logits.max(-1).values)
    assert torch.equal(ids, logits.argmax(-1))


def test_greedy_head_declines_nan(kernels):
    if not kernels.has_bf16_dot:
        pytest.skip("this CPU has no AVX512-BF16: the greedy head is not built")
    w = torch.randn(40, 16, generator=_gen(7)).to(BF16)
    x = torch.randn(2, 16, generator=_gen(8)).to(BF16)
    x[1, 3] = float("nan")
    assert kernels.greedy_head(x, kernels.pack_greedy_head(w), 40) is None


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("m,n,k", [(1, 37, 24), (6, 16, 7), (13, 100, 64), (17, 576, 96)])
@pytest.mark.parametrize("threads", [1, 2])
def test_bf16_weight_linear_matches_float64(kernels, dtype, m, n, k, threads):
    """bf16 weights, float32 arithmetic: tiles of 6 rows and blocks of 16 outputs with tails, a
    bias, one or two OpenMP threads; the float32 result is within float32 sum-order noise of
    float64 math on the same bf16 weights, the bf16 one rounds that (one bf16 step at most)."""
    g = _gen(9)
    w = (torch.randn(n, k, generator=g) * 0.2).to(BF16)
    x = torch.randn(2, m, k, generator=g).to(dtype)  # [..., K]: leading dims are flattened
    bias = torch.randn(n, generator=g).to(dtype)
    ref = x.double() @ w.double().T + bias.double()  # [2, m, n]
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = kernels.linear(x, kernels.pack_linear(w), n, bias)
        no_bias = kernels.linear(x, kernels.pack_linear(w), n)
    finally:
        torch.set_num_threads(old)
    assert out.shape == (2, m, n) and out.dtype == dtype
    if dtype == F32:
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(no_bias.double(), ref - bias.double(), rtol=1e-5, atol=1e-5)
    else:
        assert_bf16_same_rounding(out, ref.to(BF16))


@pytest.mark.parametrize("threads", [1, 2])
def test_bf16_weight_linear_row_does_not_depend_on_its_batch(kernels, threads):
    """Tiles of 1-6 tokens span 6-1 output blocks, rows past a tile run over the same block
    group, and threads split the blocks: a token's output must be the same
    bits whatever rows are batched with it, as a speculative verify's rows are compared with
    plain decode steps of one row. n = 37 blocks: every tile width meets a tail."""
    g = _gen(11)
    n, k = 37 * 16 - 5, 96
    w = (torch.randn(n, k, generator=g) * 0.2).to(BF16)
    packed = kernels.pack_linear(w)
    x = torch.randn(26, k, generator=g).to(BF16)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        alone = torch.cat([kernels.linear(x[i : i + 1], packed, n) for i in range(26)])
        for m in list(range(1, 15)) + [25, 26]:
            assert torch.equal(kernels.linear(x[:m], packed, n), alone[:m]), m
    finally:
        torch.set_num_threads(old)
    assert_bf16_same_rounding(alone, (x.double() @ w.double().T).to(BF16))


def test_bf16_weight_linear_matches_torch_bf16_linear(kernels):
    """What a bf16 model's Linear computed before (F.linear in bf16): the same values up to the
    sum order (one bf16 step at most, for a few)."""
    g = _gen(10)
    w = (torch.randn(300, 128, generator=g) * 0.1).to(BF16)
    x = torch.randn(16, 128, generator=g).to(BF16)
    # float32 sums in two orders differ by up to ~k eps32 of the terms' magnitude: a value that
    # cancels to near zero (seen: 1.49e-5 against torch's 1.478e-5, float64 1.483e-5) may differ
    # by more than its own bf16 step
    noise = 128 * 2.0**-24 * (x.abs().float() @ w.abs().float().T)
    assert_bf16_same_rounding(kernels.linear(x, kernels.pack_linear(w), 300), F.linear(x, w),
                              noise)


@pytest.mark.parametrize("cc", ["false", "no-such-compiler-here"])
def test_failed_build_means_no_kernels(tmp_path, cc):
    """A compiler that fails, or that cannot be run: no kernels (torch ops), nothing half-built."""
    assert load_cpu_kernels(str(tmp_path), cc) is None
    assert not list((tmp_path / "kernels").iterdir())
