"""MLA's fused rope + latent norm (+ KV store) kernel (kernels/triton/mla_rope.py) and its per-head
GEMV (kernels/triton/head_gemv.py) against the torch paths they replace in `MLAttention` and a
float64 oracle; both rope styles. Without CUDA: Triton's interpreter, float32 only; with CUDA also
bfloat16 (within 1 ulp of the torch path)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from test_triton_ops import (DEVICE, DTYPES, EPS, OPS, close_to_oracle,  # noqa: E402
                             close_to_torch, rand)
from transformers import DeepseekV3Config  # noqa: E402

from moeserve.kernels.triton.attention import KVStoreTarget  # noqa: E402
from moeserve.layers.norm import RMSNorm  # noqa: E402
from moeserve.layers.rotary import RotaryEmbedding  # noqa: E402
from moeserve.models.deepseek import MLAttention  # noqa: E402


def _rope(r: int, interleaved: bool) -> RotaryEmbedding:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, r, 2, dtype=torch.float32) / r))
    with torch.device(DEVICE):
        return RotaryEmbedding(inv_freq, 1.0, 64, is_neox_style=not interleaved)


def _rope_oracle(x: torch.Tensor, pos: torch.Tensor, r: int, interleaved: bool) -> torch.Tensor:
    """[T, N, r] float64: rotate pairs (2i, 2i + 1) or (i, i + r/2) by pos * 10000^(-2i/r)."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, r, 2, dtype=torch.float64) / r))
    ang = pos.cpu().double()[:, None, None] * inv_freq.to(DEVICE)[None, None, :].cpu()
    cos, sin = ang.cos().to(DEVICE), ang.sin().to(DEVICE)
    x = x.double()
    i1, i2 = (slice(0, r, 2), slice(1, r, 2)) if interleaved else (slice(0, r // 2),
                                                                   slice(r // 2, r))
    out = x.clone()
    out[..., i1] = x[..., i1] * cos - x[..., i2] * sin
    out[..., i2] = x[..., i2] * cos + x[..., i1] * sin
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [0, 1, 5])
@pytest.mark.parametrize("h,nope,r,big_r", [(3, 16, 8, 32), (20, 8, 16, 48), (17, 32, 64, 512)])
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("with_store", [False, True])
def test_mla_rope_norm_matches_torch_path(dtype, t, h, nope, r, big_r, interleaved, with_store):
    gen = torch.Generator().manual_seed(t * 1000 + h * 10 + r + interleaved)
    rope = _rope(r, interleaved)
    norm = RMSNorm(big_r, EPS).to(DEVICE, dtype)
    norm.weight.data.copy_(rand(big_r, gen=gen) * 0.5 + 1)
    q = rand(t, h, nope + r, dtype=dtype, gen=gen)
    kv = rand(t, big_r + r, dtype=dtype, gen=gen) * 3
    pos = torch.randint(0, 64, (t,), generator=gen).to(DEVICE)
    # the torch path of MLAttention.prepare
    c_kv, k_pe = kv.split([big_r, r], dim=-1)
    q_pe, k_pe = rope(pos, q[..., nope:], k_pe[:, None])
    want = torch.cat([norm(c_kv)[:, None], k_pe], dim=-1)
    slots = 9
    k_buf = rand(slots + 1, 1, big_r + r, dtype=dtype, gen=gen)
    k_before = k_buf.clone()
    loc = torch.randperm(slots, generator=gen)[:t].add(1).to(DEVICE)
    store = KVStoreTarget(k_buf, k_buf, loc) if with_store else None
    ours_q = q.clone()
    latent = OPS.mla_rope_norm(ours_q, kv, pos, rope.cos_sin_cache, interleaved, norm.weight, EPS,
                               store)
    assert torch.equal(ours_q[..., :nope], q[..., :nope])  # the nope channels untouched
    close_to_torch(ours_q[..., nope:], q_pe)
    close_to_torch(latent, want)
    close_to_oracle(ours_q[..., nope:], _rope_oracle(q[..., nope:], pos, r, interleaved))
    close_to_oracle(latent[..., big_r:], _rope_oracle(kv[:, None, big_r:], pos, r, interleaved))
    if with_store:  # the latent rows at loc, no other row
        k_want = k_before.clone()
        k_want[loc] = latent
        assert torch.equal(k_buf, k_want)


@pytest.mark.parametrize("interleave", [True, False])
def test_mla_prepare_with_gpu_ops_equals_torch_path(interleave):
    """MLAttention.prepare with TritonOps attached (one fused launch between the projections)
    gives the torch path's absorbed q and latent (DeepSeek-V3 layout, q LoRA, both rope styles)."""
    cfg = DeepseekV3Config(hidden_size=64, num_attention_heads=4, q_lora_rank=32, kv_lora_rank=48,
                           qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                           max_position_embeddings=64, rope_interleave=interleave)
    torch.manual_seed(3)
    with torch.device(DEVICE):
        attn = MLAttention(cfg, 0)
    for p in attn.parameters():
        p.data.copy_(torch.randn(p.shape) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
    x = rand(5, 64)
    pos = torch.tensor([0, 3, 7, 11, 63], device=DEVICE)
    ref_q, ref_latent, ref_stored, ref_mha = attn.prepare(x, pos)
    o = rand(5, 4 * 48)  # an attention output [T, H * R]
    ref_out = attn.output(o)
    calls = []

    class CountingOps(type(OPS)):
        def mla_rope_norm(self, *args, **kwargs):
            calls.append("rope")
            return super().mla_rope_norm(*args, **kwargs)

        def head_gemv(self, x, *args, **kwargs):
            calls.append(f"head_gemv {x.shape[0]}")
            return super().head_gemv(x, *args, **kwargs)

    attn.gpu_ops = CountingOps()  # this module's only: projections and norms stay as they were
    q, latent, stored, mha = attn.prepare(x, pos)
    assert not ref_stored and not stored  # no forward batch: the backend stores
    assert not ref_mha and not mha  # and the absorbed form
    close_to_torch(q, ref_q)
    close_to_torch(latent, ref_latent)
    torch.testing.assert_close(attn.output(o), ref_out, rtol=1e-5, atol=1e-5)
    q1, latent1, _, _ = attn.prepare(x[:1], pos[:1])  # decode's one token: the per-head GEMV
    torch.testing.assert_close(q1, ref_q[:1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(attn.output(o[:1]), ref_out[:1], rtol=1e-5, atol=1e-5)
    # 5 tokens: rope fused, head_gemv declines (einsum); 1 token: both kernels run
    assert calls == ["rope", "head_gemv 5", "head_gemv 5", "rope", "head_gemv 1", "head_gemv 1"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("h,k,n", [(4, 16, 48), (3, 128, 512), (5, 512, 128), (2, 100, 70)])
@pytest.mark.parametrize("k_major", [True, False])
def test_head_gemv_matches_einsum_and_float64(dtype, h, k, n, k_major):
    """One token's per-head products (kernels/triton/head_gemv.py) against the einsum MLA ran and a
    float64 oracle; x a strided view as q_nope is (the head stride spans the rope channels)."""
    gen = torch.Generator().manual_seed(h * k + n + k_major)
    x = rand(1, h, k + 8, dtype=dtype, gen=gen)[..., :k]  # rows of k + 8, like q's nope part
    w = rand(h, k, n, dtype=dtype, gen=gen) if k_major else rand(h, n, k, dtype=dtype, gen=gen)
    w = w / k**0.5
    eq = "thk,hkn->thn" if k_major else "thk,hnk->thn"
    ours = OPS.head_gemv(x, w, k_major)
    assert ours.shape == (1, h, n) and ours.dtype == dtype
    oracle = torch.einsum(eq, x.double(), w.double())
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(ours.double(), oracle, rtol=tol, atol=tol)
    torch.testing.assert_close(ours, torch.einsum(eq, x, w), rtol=tol, atol=tol)
    assert OPS.head_gemv(x.expand(2, h, k), w, k_major) is None  # one token only
    assert OPS.head_gemv(x, w.double(), k_major) is None  # dtypes differ


@pytest.mark.parametrize("block,h,nope,v,r", [((32, 32), 3, 32, 32, 64), ((16, 32), 2, 32, 48, 96),
                                              ((128, 128), 2, 128, 128, 512)])
def test_head_gemv_on_fp8_kv_b_matches_float64_on_dequantized_weights(block, h, nope, v, r):
    """kv_b_proj resident in FP8 (e4m3 + block scales): the per-head GEMV over W_UK and W_UV
    views of it against float64 einsums on the dequantized matrix (the second case's W_UK spans
    two scale rows per head); heads whose rows do not start on a scale block are declined
    (None: MLA then runs its einsum)."""
    from moeserve.kernels.fp8_format import dequantize_fp8_blocks, quantize_fp8_blocks

    gen = torch.Generator().manual_seed(h * nope + r)
    w = torch.randn(h * (nope + v), r, generator=gen) / r**0.5
    w[:, :5] *= 30  # blocks of very different scales
    w_q, w_s = (t.to(DEVICE) for t in quantize_fp8_blocks(w, block))
    deq = dequantize_fp8_blocks(w_q.cpu(), w_s.cpu(), block).double().view(h, nope + v, r)
    w_uk, w_uv = w_q.view(h, nope + v, r).split([nope, v], dim=1)
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    q_nope = rand(1, h, nope + 8, dtype=dtype, gen=gen)[..., :nope]
    o = rand(1, h, r, dtype=dtype, gen=gen)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for x, wv, k_major, ref in ((q_nope, w_uk, True, torch.einsum(
            "thn,hnr->thr", q_nope.double().cpu(), deq[:, :nope])), (o, w_uv, False, torch.einsum(
            "thr,hvr->thv", o.double().cpu(), deq[:, nope:]))):
        ours = OPS.head_gemv(x, wv, k_major, w_scale=w_s, block=block)
        assert ours is not None and ours.dtype == dtype
        torch.testing.assert_close(ours.double().cpu(), ref, rtol=tol, atol=tol)
    tall = (block[0] * 2, block[1])  # W_UV's rows would start inside a scale block
    w_q2, w_s2 = quantize_fp8_blocks(w.to(DEVICE), tall)
    assert OPS.head_gemv(o, w_q2.view(h, nope + v, r)[:, nope:], False, w_scale=w_s2,
                         block=tall) is None
