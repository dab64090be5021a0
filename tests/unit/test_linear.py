"""The CPU-prepacked Linear gives F.linear's bf16 outputs bit for bit, and packs only where it can."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moeserve.layers.linear import Linear, MergedLinear, onednn_bf16_linear_works, pack_linears


def _linear(cls, *args, dtype=torch.bfloat16, bias=False):
    g = torch.Generator().manual_seed(0)
    m = cls(*args, bias=bias).to(dtype)
    with torch.no_grad():
        m.weight.copy_(torch.randn(m.weight.shape, generator=g))
        if bias:
            m.bias.copy_(torch.randn(m.bias.shape, generator=g))
    return m


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("tokens", [1, 7, 16, 300])
def test_packed_equals_f_linear_bf16(bias, tokens):
    m = _linear(Linear, 96, 200, bias=bias)
    if not m.pack():
        pytest.skip("no oneDNN bf16 linear on this CPU or torch build (probed)")
    x = torch.randn(tokens, 96, generator=torch.Generator().manual_seed(1)).bfloat16()
    assert torch.equal(m(x), F.linear(x, m.weight, m.bias))
    x3 = x.view(1, tokens, 96)  # leading dims are kept
    assert torch.equal(m(x3), F.linear(x3, m.weight, m.bias))
    strided = torch.cat([x, x[:, :32]], dim=1)[:, :96]  # a column slice, as after a split
    assert torch.equal(m(strided), F.linear(strided, m.weight, m.bias))


def test_pack_linears_packs_bf16_cpu_only():
    model = torch.nn.Sequential(_linear(Linear, 8, 8), _linear(MergedLinear, 8, [4, 4], ["a", "b"]),
                                _linear(Linear, 8, 8, dtype=torch.float32), torch.nn.Linear(8, 8))
    expected = 2 if onednn_bf16_linear_works() else 0
    assert pack_linears(model) == expected
    assert model[2].packed is None  # float32 stays on F.linear (oneDNN rounds differently there)


def test_probe_off_falls_back_to_f_linear(monkeypatch):
    """A CPU without oneDNN bf16 (AVX2-only) packs nothing and still computes F.linear."""
    import moeserve.layers.linear as linear

    monkeypatch.setattr(linear, "onednn_bf16_linear_works", lambda: False)
    m = _linear(Linear, 16, 24)
    assert not m.pack() and m.packed is None
    x = torch.randn(3, 16).bfloat16()
    assert torch.equal(m(x), F.linear(x, m.weight))
