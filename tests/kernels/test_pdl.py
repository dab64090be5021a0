"""Programmatic dependent launch (kernels/triton/pdl.py) on a Hopper GPU: a decode-layer-like chain
of the kernels that take `pdl` (RMSNorm, GEMV, q/k norm + rope with the KV store, split-KV decode,
the one-token router, the small fused MoE, the sorted fused MoE), launched with PDL inside a CUDA
graph and replayed on fresh inputs, must give bit for bit what plain launches give. A kernel that
read its predecessor's output (or wrote a buffer still being read) before its wait would race, and
these chains make each kernel depend on the one just before it."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("PDL needs CUDA", allow_module_level=True)

from moeserve.kernels.triton.fused_moe import fused_moe  # noqa: E402
from moeserve.kernels.triton.pdl import pdl_supported  # noqa: E402
from moeserve.kernels.triton.attention import decode_attention  # noqa: E402
from moeserve.kernels.triton.ops import TritonOps  # noqa: E402

DEV = torch.device("cuda")
if not pdl_supported(DEV):
    pytest.skip("no sm90+ GPU or no griddepcontrol in this Triton", allow_module_level=True)

H, HEADS, KV_HEADS, D, E, TOP_K, INTER, LAYERS, SLOTS = 1024, 8, 2, 128, 32, 4, 256, 6, 8192


def _weights(g: torch.Generator) -> list[dict]:
    def w(*shape, scale=0.05):
        return (torch.randn(*shape, generator=g) * scale).to(DEV, torch.bfloat16)

    table = torch.randn(SLOTS, 2 * D, generator=g).to(DEV)  # any float32 rope table
    return [dict(norm=1 + w(H), qkv=w((HEADS + 2 * KV_HEADS) * D, H), o=w(H, HEADS * D),
                 norm2=1 + w(H), router=w(E, H), w13=w(E, 2 * INTER, H), w2=w(E, H, INTER),
                 qn=1 + w(D), kn=1 + w(D), rope=table) for _ in range(LAYERS)]


def _step(ops: TritonOps, x: torch.Tensor, positions, loc, kv, req_rows, seq_lens, table, layers,
          pdl: bool) -> torch.Tensor:
    """A batch of decode tokens through LAYERS layer-like chains; every kernel reads the output
    of the kernel launched just before it."""
    from moeserve.kernels.triton.attention import KVStoreTarget

    t = x.shape[0]
    residual = x
    h, residual = ops.rms_norm(x, layers[0]["norm"], 1e-6, residual=torch.zeros_like(x))
    for i, lw in enumerate(layers):
        qkv = ops.linear(h, lw["qkv"]) if t == 1 else h @ lw["qkv"].t()
        k_buf, v_buf = kv[i]
        ops.qk_norm_rope(qkv, HEADS, KV_HEADS, D, positions, lw["rope"], D, lw["qn"], lw["kn"],
                         1e-6, KVStoreTarget(k_buf, v_buf, loc))
        q = qkv[:, : HEADS * D].view(t, HEADS, D)
        out = torch.empty((t, HEADS, D), dtype=x.dtype, device=DEV)
        part_out = torch.empty((t, HEADS, 8, D), dtype=torch.float32, device=DEV)
        part_lse = torch.empty((t, HEADS, 8), dtype=torch.float32, device=DEV)
        decode_attention(q, k_buf, v_buf, table, req_rows, seq_lens, D ** -0.5, D, D, out,
                         part_out, part_lse, pdl=pdl)
        o = out.view(t, HEADS * D)
        a = ops.linear(o, lw["o"]) if t == 1 else o @ lw["o"].t()
        h, residual = ops.rms_norm(a, lw["norm2"], 1e-6, residual=residual)
        routed = ops.router_topk(h, lw["router"], TOP_K, True) if t == 1 else None
        if routed is None:
            routed = ops.topk_softmax(h @ lw["router"].t(), TOP_K, True)
        weights, ids = routed
        m = fused_moe(h, lw["w13"], lw["w2"], ids, weights, pdl=pdl)
        h, residual = ops.rms_norm(m, layers[(i + 1) % LAYERS]["norm"], 1e-6, residual=residual)
    return h


@pytest.mark.parametrize("batch", [1, 3, 16])
def test_pdl_chain_in_a_graph_equals_plain_launches(batch):
    g = torch.Generator().manual_seed(batch)
    layers = _weights(g)
    ctx = 300  # tokens already in the cache per request (random K/V)
    kv = [(torch.randn(SLOTS + 1, KV_HEADS, D, generator=g).to(DEV, torch.bfloat16),
           torch.randn(SLOTS + 1, KV_HEADS, D, generator=g).to(DEV, torch.bfloat16))
          for _ in range(LAYERS)]
    table = torch.arange(batch * (ctx + 1), dtype=torch.int32, device=DEV).view(batch, ctx + 1)
    req_rows = torch.arange(batch, device=DEV)
    seq_lens = torch.full((batch,), ctx + 1, dtype=torch.int32, device=DEV)
    positions = torch.full((batch,), ctx, dtype=torch.int64, device=DEV)
    loc = table[:, ctx].to(torch.int64)
    static_x = torch.zeros(batch, H, dtype=torch.bfloat16, device=DEV)

    results = {}
    for pdl in (False, True):
        ops = TritonOps(pdl=pdl)
        caches = [(k.clone(), v.clone()) for k, v in kv]
        args = (positions, loc, caches, req_rows, seq_lens, table, layers, pdl)
        _step(ops, static_x, *args)  # compile and warm up outside the graph
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = _step(ops, static_x, *args)
        outs = []
        for r in range(4):
            static_x.copy_((torch.randn(batch, H, generator=torch.Generator().manual_seed(r))
                            ).to(DEV, torch.bfloat16))
            graph.replay()
            outs.append(out.clone())
        eager = _step(ops, static_x, *args)  # eager launches (with or without PDL) too
        torch.cuda.synchronize()
        results[pdl] = (outs, eager)
    plain, with_pdl = results[False], results[True]
    for r, (a, b) in enumerate(zip(plain[0], with_pdl[0])):
        assert not a.isnan().any()
        assert torch.equal(a, b), f"replay {r}: PDL graph differs from plain launches"
    assert torch.equal(plain[1], with_pdl[1])
    assert torch.equal(plain[1], plain[0][-1])
