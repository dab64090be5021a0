"""TritonOps (rms_norm, qk_norm_rope, topk_softmax) against a float64 oracle and against the torch
paths they replace. Without CUDA: Triton's interpreter, float32 only (its bf16 math is wrong);
with CUDA also bfloat16, where results must match the torch path within 1 bf16 ulp."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

pytest.importorskip("triton")

from moeserve.kernels.attach import attach_ops  # noqa: E402
from moeserve.kernels.triton.ops import TritonOps  # noqa: E402
from moeserve.layers.norm import RMSNorm, rms_norm_heads  # noqa: E402
from moeserve.layers.rotary import RotaryEmbedding  # noqa: E402
from moeserve.layers.router import RouterConfig, select_experts  # noqa: E402
from moeserve.models import qwen3_moe  # noqa: E402
from moeserve.models.llama import Attention  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
OPS = TritonOps()
EPS = 1e-6


def rand(*shape, dtype=torch.float32, gen=None) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float32).to(DEVICE, dtype)


def close_to_torch(ours: torch.Tensor, ref: torch.Tensor) -> None:
    """float32: equal up to a few float32 ulps (rsqrt, sum order); bf16: within 1 ulp."""
    assert ours.dtype == ref.dtype and ours.shape == ref.shape
    if ours.dtype == torch.bfloat16:
        ulps = (ours.view(torch.int16).int() - ref.view(torch.int16).int()).abs()
        assert ulps.numel() == 0 or int(ulps.max()) <= 1
    else:
        torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)


def close_to_oracle(ours: torch.Tensor, oracle: torch.Tensor) -> None:
    tol = 1e-5 if ours.dtype == torch.float32 else 2**-7
    torch.testing.assert_close(ours.double(), oracle, rtol=tol, atol=tol)


# ---------------------------------------------------------------- rms_norm


def rms_oracle(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    x = x.double()
    return w.double() * x / (x.pow(2).mean(-1, keepdim=True) + EPS).sqrt()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,h", [(0, 48), (1, 48), (5, 100), (3, 256)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype, t, h, with_residual):
    gen = torch.Generator().manual_seed(t * 1000 + h)
    norm = RMSNorm(h, EPS).to(DEVICE, dtype)
    norm.weight.data.copy_(rand(h, gen=gen) * 0.5 + 1)
    x = rand(t, h + 16, dtype=dtype, gen=gen)[:, :h]  # strided rows, as the CPU kernel allows
    residual = rand(t, h, dtype=dtype, gen=gen) if with_residual else None
    x0, r0 = x.clone(), None if residual is None else residual.clone()
    ours = OPS.rms_norm(x, norm.weight, EPS, residual)
    ref = norm(x, residual)  # the torch path (no ops attached)
    assert torch.equal(x, x0) and (residual is None or torch.equal(residual, r0))  # not mutated
    if with_residual:
        close_to_torch(ours[0], ref[0])
        assert torch.equal(ours[1], ref[1])  # the sum: one rounding, bit-identical
        close_to_oracle(ours[1], x.double() + residual.double())
        close_to_oracle(ours[0], rms_oracle(ours[1], norm.weight))
    else:
        close_to_torch(ours, ref)
        close_to_oracle(ours, rms_oracle(x, norm.weight))


def test_rms_norm_module_uses_ops():
    norm = RMSNorm(32, EPS).to(DEVICE)
    norm.weight.data.copy_(rand(32))
    x, r = rand(3, 32), rand(3, 32)
    assert OPS.usable(x)  # else the modules fall back to torch, and these tests prove nothing
    ref = norm(x, r)
    assert attach_ops(norm, "gpu_ops", OPS) == 1
    ours = norm(x, r)
    close_to_torch(ours[0], ref[0])
    assert torch.equal(ours[1], ref[1])


# ---------------------------------------------------------------- qk_norm_rope


def qk_oracle(qk: torch.Tensor, h: int, qw, kw, table: torch.Tensor, pos: torch.Tensor,
              rd: int) -> torch.Tensor:
    """[T, N, D] float64: per-head RMSNorm (if weights), then neox rope on the first rd."""
    x = qk.double()
    if qw is not None:
        w = torch.cat([qw.expand(h, -1), kw.expand(x.shape[1] - h, -1)]).double()
        x = w * x / (x.pow(2).mean(-1, keepdim=True) + EPS).sqrt()
    row = table[pos].double()[:, None]  # [T, 1, 2 rd]: cos | cos | -sin | sin
    cos, sin = row[..., : rd // 2], row[..., rd + rd // 2 :]
    x1, x2 = x[..., : rd // 2], x[..., rd // 2 : rd]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., rd:]], dim=-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [0, 1, 3])
@pytest.mark.parametrize("h,hkv,d,rd", [(4, 2, 16, 16), (3, 1, 16, 8), (2, 2, 32, 12)])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_qk_norm_rope(dtype, t, h, hkv, d, rd, qk_norm):
    gen = torch.Generator().manual_seed(t * 100 + h * 10 + rd)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rd, 2, dtype=torch.float32) / rd))
    with torch.device(DEVICE):
        rope = RotaryEmbedding(inv_freq, 1.0, 64)
    qn, kn = RMSNorm(d, EPS).to(DEVICE, dtype), RMSNorm(d, EPS).to(DEVICE, dtype)
    qn.weight.data.copy_(rand(d, gen=gen) * 0.5 + 1)
    kn.weight.data.copy_(rand(d, gen=gen) * 0.5 + 1)
    qkv = rand(t, (h + 2 * hkv) * d, dtype=dtype, gen=gen)
    pos = torch.randint(0, 64, (t,), generator=gen).to(DEVICE)
    qk = qkv[:, : (h + hkv) * d].view(t, h + hkv, d)
    normed = rms_norm_heads(qk, [(h, qn), (hkv, kn)]) if qk_norm else qk
    ref = rope.rotate(pos, normed)  # the torch path (as Attention.forward)
    oracle = qk_oracle(qk, h, qn.weight if qk_norm else None, kn.weight, rope.cos_sin_cache, pos,
                       rd)
    ours = qkv.clone()
    weights = (qn.weight, kn.weight) if qk_norm else (None, None)
    OPS.qk_norm_rope(ours, h, hkv, d, pos, rope.cos_sin_cache, rd, *weights, EPS)
    assert torch.equal(ours[:, (h + hkv) * d :], qkv[:, (h + hkv) * d :])  # v untouched
    ours_qk = ours[:, : (h + hkv) * d].view(t, h + hkv, d)
    close_to_torch(ours_qk, ref)
    close_to_oracle(ours_qk, oracle)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [1, 5])
@pytest.mark.parametrize("h,hkv,d,rd", [(4, 2, 16, 16), (3, 1, 16, 8), (8, 4, 32, 24)])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_qk_norm_rope_stores_kv(dtype, t, h, hkv, d, rd, qk_norm):
    """With a store target the kernel also writes the final k heads and the v heads to the pool
    rows at loc (exactly the values left in qkv), and no other row."""
    from moeserve.kernels.triton.attention import KVStoreTarget

    gen = torch.Generator().manual_seed(7 * t + h + rd)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rd, 2, dtype=torch.float32) / rd))
    with torch.device(DEVICE):
        rope = RotaryEmbedding(inv_freq, 1.0, 64)
    weights = (rand(d, gen=gen, dtype=dtype) + 1, rand(d, gen=gen, dtype=dtype) + 1) if qk_norm \
        else (None, None)
    qkv = rand(t, (h + 2 * hkv) * d, dtype=dtype, gen=gen)
    pos = torch.randint(0, 64, (t,), generator=gen).to(DEVICE)
    slots = 12
    k_buf = rand(slots + 1, hkv, d, dtype=dtype, gen=gen)
    v_buf = rand(slots + 1, hkv, d, dtype=dtype, gen=gen)
    k_before, v_before = k_buf.clone(), v_buf.clone()
    loc = torch.randperm(slots, generator=gen)[:t].add(1).to(DEVICE)
    plain = qkv.clone()
    OPS.qk_norm_rope(plain, h, hkv, d, pos, rope.cos_sin_cache, rd, *weights, EPS)
    fused = qkv.clone()
    OPS.qk_norm_rope(fused, h, hkv, d, pos, rope.cos_sin_cache, rd, *weights, EPS,
                     store=KVStoreTarget(k_buf, v_buf, loc))
    assert torch.equal(fused, plain)  # the in-place result does not change
    rows = plain.view(t, h + 2 * hkv, d)
    k_want, v_want = k_before.clone(), v_before.clone()
    k_want[loc], v_want[loc] = rows[:, h: h + hkv], rows[:, h + hkv:]
    assert torch.equal(k_buf, k_want) and torch.equal(v_buf, v_want)


# ---------------------------------------------------------------- topk_softmax


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,e", [(0, 8), (1, 8), (7, 60), (5, 128), (3, 320)])
@pytest.mark.parametrize("k", [1, 2, 3, 8])
@pytest.mark.parametrize("renormalize", [False, True])
def test_topk_softmax(dtype, t, e, k, renormalize):
    gen = torch.Generator().manual_seed(t * 1000 + e + k)
    logits = rand(t, e, dtype=dtype, gen=gen) * 3
    weights, ids = OPS.topk_softmax(logits, k, renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    assert weights.shape == ids.shape == (t, k)
    ref_w, ref_ids = select_experts(logits, RouterConfig(top_k=k, renormalize=renormalize))
    # bf16 logits tie often; tied experts may come in another order than torch.topk's, with the
    # same values
    assert torch.equal(logits.gather(1, ids), logits.gather(1, ref_ids))
    if dtype == torch.float32:
        assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w, rtol=1e-6, atol=1e-7)
    probs = logits.double().softmax(-1)
    oracle = probs.gather(1, ids)  # the chosen ids are the top k of the float64 softmax
    assert torch.equal(probs.topk(k, dim=-1).values, oracle)
    if renormalize:
        oracle = oracle / oracle.sum(-1, keepdim=True)
    torch.testing.assert_close(weights.double(), oracle, rtol=1e-5, atol=1e-7)


def test_topk_softmax_ties_take_lower_ids():
    logits = torch.zeros(2, 12, device=DEVICE)
    logits[1, 7] = 1.0
    weights, ids = OPS.topk_softmax(logits, 4, renormalize=True)
    assert ids.tolist() == [[0, 1, 2, 3], [7, 0, 1, 2]]
    torch.testing.assert_close(weights[0], torch.full((4,), 0.25, device=DEVICE))


def test_k_up_to_8_and_e_512():
    logits = rand(2, 512)
    for k in range(1, 9):
        weights, ids = OPS.topk_softmax(logits, k, renormalize=True)
        ref_w, ref_ids = select_experts(logits, RouterConfig(top_k=k))
        assert torch.equal(ids, ref_ids)
        torch.testing.assert_close(weights, ref_w, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("e,hidden,k", [(8, 64, 2), (60, 96, 4), (128, 256, 8), (320, 40, 8)])
@pytest.mark.parametrize("renormalize", [False, True])
def test_router_topk_one_token(dtype, e, hidden, k, renormalize):
    """The one-launch router (linear + softmax top-k, the last program selecting) chooses the
    experts of the float64 softmax over the logits it rounds, equal to the two-launch path; a
    second call (the arrival counter reset by the first) gives the same."""
    gen = torch.Generator().manual_seed(e + hidden + k)
    x = rand(1, hidden, dtype=dtype, gen=gen)
    w = rand(e, hidden, dtype=dtype, gen=gen) * 0.2
    for _ in range(2):
        weights, ids = OPS.router_topk(x, w, k, renormalize)
        assert weights.shape == ids.shape == (1, k) and ids.dtype == torch.int64
        logits = (x.double() @ w.double().T).to(dtype)  # rounded as the linear's output
        probs = logits.double().softmax(-1)
        assert torch.equal(probs.gather(1, ids), probs.topk(k, dim=-1).values)
        oracle = probs.gather(1, ids)
        if renormalize:
            oracle = oracle / oracle.sum(-1, keepdim=True)
        torch.testing.assert_close(weights.double(), oracle, rtol=1e-5, atol=1e-7)
        if dtype == torch.float32:
            two = OPS.topk_softmax(torch.nn.functional.linear(x, w), k, renormalize)
            assert torch.equal(ids, two[1])
            torch.testing.assert_close(weights, two[0], rtol=1e-5, atol=1e-7)


def test_router_topk_declines_what_it_does_not_do():
    x, w = rand(2, 32), rand(8, 32)
    assert OPS.router_topk(x, w, 2, True) is None  # two rows: the two-launch path
    assert OPS.router_topk(x[:1], w.double(), 2, True) is None  # another dtype


def grouped_oracle(logits, cfg: RouterConfig, bias):
    """float64 reference of DeepSeek's routing, written out from its definition."""
    x = logits.double()
    s = x.sigmoid() if cfg.scoring == "sigmoid" else x.softmax(-1)
    c = s + (bias.double() if bias is not None else 0)
    t, e = c.shape
    g = c.view(t, cfg.num_groups, e // cfg.num_groups)
    gs = g.topk(2, -1).values.sum(-1) if cfg.group_score == "top2_sum" else g.max(-1).values
    keep = torch.zeros_like(gs, dtype=torch.bool).scatter_(1, gs.topk(cfg.topk_groups, -1).indices,
                                                           True)
    c = c.masked_fill(~keep.repeat_interleave(e // cfg.num_groups, 1), float("-inf"))
    ids = c.topk(cfg.top_k, -1).indices
    w = s.gather(1, ids)
    if cfg.renormalize:
        w = w / w.sum(-1, keepdim=True)
    return w * cfg.routed_scaling_factor, ids


@pytest.mark.parametrize("t", [1, 6])
@pytest.mark.parametrize("cfg,e,with_bias", [
    (RouterConfig(top_k=8, scoring="sigmoid", num_groups=8, topk_groups=4,
                  group_score="top2_sum", routed_scaling_factor=2.5), 256, True),  # DeepSeek-V3
    (RouterConfig(top_k=6, scoring="softmax", renormalize=False, num_groups=8, topk_groups=3,
                  routed_scaling_factor=16.0), 64, False),  # V2's group-limited greedy
    (RouterConfig(top_k=4, scoring="sigmoid", num_groups=1), 32, True),
    (RouterConfig(top_k=2, scoring="softmax", renormalize=False), 16, False)])
def test_grouped_topk_matches_select_experts(t, cfg, e, with_bias):
    """DeepSeek's routers in one launch choose the float64 oracle's experts, equal to the torch
    path's, with its weights."""
    gen = torch.Generator().manual_seed(t + e + cfg.top_k)
    logits = rand(t, e, gen=gen) * 2
    bias = rand(e, gen=gen) * 0.1 if with_bias else None
    ours = OPS.grouped_topk(logits, cfg, bias)
    assert ours is not None
    weights, ids = ours
    ref_w, ref_ids = select_experts(logits, cfg, bias)  # torch ops
    w64, ids64 = grouped_oracle(logits, cfg, bias)
    assert torch.equal(ids, ids64) and torch.equal(ids, ref_ids)  # same order: by choice
    torch.testing.assert_close(weights, ref_w, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(weights.double(), w64, rtol=1e-5, atol=1e-7)
    assert torch.equal(select_experts(logits, cfg, bias, kernels=OPS)[1], ids)  # wired in


def test_grouped_topk_declines_odd_shapes():
    cfg = RouterConfig(top_k=2, scoring="sigmoid", num_groups=4, topk_groups=2)
    assert OPS.grouped_topk(rand(2, 160), cfg, None) is None  # 160 experts: not a power of two
    assert OPS.grouped_topk(rand(2, 64).double(), cfg, None) is None  # float32 logits only


# ---------------------------------------------------------------- wired into a model


class _Capture(nn.Module):
    """Stands in for PagedAttention: keeps q and k, returns q as [T, H * D]."""

    def forward(self, q, k, v, fb, kv_stored=False):
        self.q, self.k = q.clone(), k.clone()
        return q.reshape(q.shape[0], -1)


@pytest.mark.parametrize("qk_norm", [False, True])  # Llama, Qwen3
def test_attention_uses_ops(qk_norm):
    cfg = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
                          head_dim=16, rms_norm_eps=EPS, max_position_embeddings=64,
                          rope_theta=10000.0)
    with torch.device(DEVICE):
        attn = Attention(cfg, 0, qk_norm=qk_norm)
    gen = torch.Generator().manual_seed(3)
    for p in attn.parameters():
        p.data.copy_(rand(*p.shape, gen=gen) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    attn.attn = _Capture()
    x, pos = rand(3, 32, gen=gen), torch.tensor([0, 5, 63], device=DEVICE)
    assert OPS.usable(x)
    ref = attn(x, pos, None), attn.attn.q, attn.attn.k
    # the attention, qkv_proj and o_proj (GEMV at one row, under no_grad), and the q/k norms
    assert attach_ops(attn, "gpu_ops", OPS) == 3 + 2 * qk_norm
    with torch.no_grad():
        ours = attn(x, pos, None), attn.attn.q, attn.attn.k
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens", [5, 1])  # 1: the one-launch router
def test_sparse_moe_block_uses_ops(monkeypatch, tokens):
    routed = []
    monkeypatch.setattr(qwen3_moe, "run_routed_experts",
                        lambda experts, x, ids, weights, *rest: routed.append((weights, ids)) or x)
    with torch.device(DEVICE):
        block = qwen3_moe.SparseMoeBlock(32, 16, 24, RouterConfig(top_k=4), 0)
    block.gate.weight.data.copy_(rand(24, 32))
    x = rand(tokens, 32)
    assert OPS.usable(x)
    block(x)
    # the block (top-k), its router linear and its experts (their launches take ops.pdl)
    assert attach_ops(block, "gpu_ops", OPS) == 3
    with torch.no_grad():
        block(x)
    (ref_w, ref_ids), (w, ids) = routed
    assert torch.equal(ids, ref_ids)
    # one token: the fused router sums its logits in another order than cuBLAS (float32 ulps)
    tol = {"rtol": 1e-5, "atol": 1e-6} if tokens == 1 else {"rtol": 1e-6, "atol": 1e-7}
    torch.testing.assert_close(w, ref_w, **tol)
