"""The grouped-GEMM and dense expert paths equal the per-expert loop, including expert-parallel
shards."""

from __future__ import annotations

import pytest
import torch

from moeserve.layers.moe import MoEExperts


def _experts(e: int, first: int = 0, num_local: int | None = None) -> MoEExperts:
    m = MoEExperts(e, 32, 24, first_expert=first, num_local=num_local)
    g = torch.Generator().manual_seed(0)
    m.w13.data = torch.randn(m.w13.shape, generator=g)[..., :] * 0.1
    m.w2.data = torch.randn(m.w2.shape, generator=g) * 0.1
    return m


@pytest.mark.parametrize("path", ["forward_grouped", "forward_dense"])
@pytest.mark.parametrize("first,num_local", [(0, None), (4, 4), (2, 3)])
def test_grouped_equals_loop(first, num_local, path):
    full = _experts(8)
    m = MoEExperts(8, 32, 24, first_expert=first, num_local=num_local)
    n = m.num_local
    m.w13.data, m.w2.data = full.w13.data[first : first + n], full.w2.data[first : first + n]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(13, 32, generator=g)
    ids = torch.stack([torch.randperm(8, generator=g)[:3] for _ in range(13)])
    w = torch.rand(13, 3, generator=g)
    torch.testing.assert_close(getattr(m, path)(x, ids, w), m.forward_loop(x, ids, w),
                               rtol=1e-5, atol=1e-6)


def test_dense_bf16_matches_grouped():
    m = _experts(8).to(torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(16, 32, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(16)])
    w = torch.rand(16, 2, generator=g)
    torch.testing.assert_close(m.forward_dense(x, ids, w), m.forward_grouped(x, ids, w))


@pytest.mark.parametrize("path", ["forward_grouped", "forward_dense"])
def test_shards_sum_to_the_whole(path):
    full = _experts(8)
    g = torch.Generator().manual_seed(2)
    x, ids, w = torch.randn(9, 32, generator=g), torch.randint(0, 8, (9, 2), generator=g), torch.rand(9, 2, generator=g)
    parts = []
    for first in (0, 4):
        m = MoEExperts(8, 32, 24, first_expert=first, num_local=4)
        m.w13.data, m.w2.data = full.w13.data[first : first + 4], full.w2.data[first : first + 4]
        parts.append(getattr(m, path)(x, ids, w))
    torch.testing.assert_close(parts[0] + parts[1], full.forward_loop(x, ids, w), rtol=1e-5,
                               atol=1e-6)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_count_per_expert_equals_bincount_without_the_spare_slot(device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from moeserve.kernels.slot_counts import count_per_expert

    slot = torch.randint(0, 9, (5000,), generator=torch.Generator().manual_seed(0))  # 8 = spare
    got = count_per_expert(slot.to(device), 8).cpu()
    assert torch.equal(got, torch.bincount(slot, minlength=9)[:8]) and got.dtype == torch.int64
