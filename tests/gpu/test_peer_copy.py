"""The p2p dispatcher's Triton kernels against their torch path (kernels/triton/peer_copy.py), on
one GPU: ordinary device buffers stand in for the peers' mappings, the torch path runs on CPU copies
of the same inputs, and every destination starts poisoned so that a stray or missing store shows.
The multi-GPU path runs in scripts/gpu_dp_check.py and bench.ep."""

from __future__ import annotations

import pytest
import torch

from moeserve.kernels.triton.peer_copy import (
    combine_rows,
    dispatch_rows,
    owner_mask,
    received_view,
    reduce_parts,
)

pytestmark = pytest.mark.gpu

CASES = [  # ep, me, top-k, hidden, dtype
    (4, 1, 8, 7168, torch.bfloat16),
    (2, 0, 3, 1000, torch.float32),
    (4, 3, 6, 7168, torch.bfloat16),
]


def _routing(t: int, k: int, num_experts: int, g: torch.Generator) -> torch.Tensor:
    """[t, k] distinct expert ids per token; one token has none (-1), like padding rows."""
    ids = torch.rand(t, num_experts, generator=g).topk(k, dim=1).indices
    ids[t // 2] = -1
    return ids


def _pair(ts: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return [x.cuda() for x in ts], [x.clone() for x in ts]


@pytest.fixture(autouse=True)
def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.cuda.set_device(0)


@pytest.mark.parametrize("max_programs", [None, 7])  # 7: a bounded grid, rows looped over
@pytest.mark.parametrize("ep,me,k,h,dtype", CASES)
def test_dispatch_rows_matches_torch(ep, me, k, h, dtype, max_programs):
    g = torch.Generator().manual_seed(ep * 10 + me)
    t, t_max, per_rank = 37, 50, 16
    x = torch.randn(t, h, generator=g).to(dtype)
    ids = _routing(t, k, per_rank * ep, g)
    w = torch.rand(t, k, generator=g)
    rows = ep * t_max + 3
    gx, cx = _pair([torch.full((rows, h), -7.0, dtype=dtype) for _ in range(ep)])
    gm, cm = _pair([torch.full((rows, 2 * k), -7, dtype=torch.int32) for _ in range(ep)])
    dispatch_rows(x.cuda(), ids.cuda(), w.cuda(), gx, gm, me, t_max, per_rank,
                  max_programs=max_programs)
    dispatch_rows(x, ids, w, cx, cm, me, t_max, per_rank)
    need = owner_mask(ids, per_rank, ep)
    for d in range(ep):
        assert torch.equal(gx[d].cpu(), cx[d]) and torch.equal(gm[d].cpu(), cm[d])
        sent = need[:, d].nonzero().squeeze(1)
        assert torch.equal(cx[d][me * t_max + sent], x[sent])  # the reference itself is right
        assert 0 < len(sent) < t
    assert (cm[0][me * t_max + t : (me + 1) * t_max, :k] == -1).all()  # padding rows: no expert


@pytest.mark.parametrize("max_programs", [None, 7])
@pytest.mark.parametrize("ep,me,k,h,dtype", CASES)
def test_combine_rows_matches_torch(ep, me, k, h, dtype, max_programs):
    g = torch.Generator().manual_seed(ep * 10 + me + 1)
    t_max, per_rank = 50, 16
    y = torch.randn(ep * t_max, h, generator=g).to(dtype)
    meta = torch.cat([_routing(ep * t_max, k, per_rank * ep, g).int(),
                      torch.rand(ep * t_max, k, generator=g).view(torch.int32)], 1)
    gy, cy = _pair([torch.full((ep * t_max, h), -7.0, dtype=dtype) for _ in range(ep)])
    combine_rows(y.cuda(), meta.cuda(), gy, me, t_max, me * per_rank, per_rank,
                 max_programs=max_programs)
    combine_rows(y, meta, cy, me, t_max, me * per_rank, per_rank)
    mine = owner_mask(meta[:, :k].long(), per_rank, ep)[:, me]
    for s in range(ep):
        assert torch.equal(gy[s].cpu(), cy[s])
        block = slice(s * t_max, (s + 1) * t_max)
        back = cy[s][me * t_max : (me + 1) * t_max]
        if s == me:
            assert (back == -7).all()  # the own block stays in the expert output
        else:
            assert torch.equal(back[mine[block]], y[block][mine[block]])
            assert (back[~mine[block]] == -7).all()


@pytest.mark.parametrize("ep,me,k,h,dtype", CASES)
def test_reduce_parts_matches_torch_and_skips_unsent_rows(ep, me, k, h, dtype):
    g = torch.Generator().manual_seed(ep * 10 + me + 2)
    t, t_max, per_rank = 37, 50, 16
    ids = _routing(t, k, per_rank * ep, g)
    need = owner_mask(ids, per_rank, ep)
    parts = torch.randn(ep, t_max, h, generator=g).to(dtype)
    own = torch.randn(t, h, generator=g).to(dtype)
    for r in range(ep):  # rows nobody wrote: NaN must never be read
        parts[r, :t][~need[:, r]] = float("nan")
    own[~need[:, me]] = float("nan")
    got = reduce_parts(parts.cuda(), own.cuda(), ids.cuda(), me, per_rank, torch.float32).cpu()
    ref = reduce_parts(parts, own, ids, me, per_rank, torch.float32)
    assert torch.equal(got, ref)
    dense = sum(torch.where(need[:, r, None], (own if r == me else parts[r, :t]).double(), 0.0)
                for r in range(ep))
    torch.testing.assert_close(ref, dense.float(), rtol=1e-6, atol=1e-6)
    assert (ref[t // 2] == 0).all()  # the token routed nowhere


@pytest.mark.parametrize("k,first,num_local", [(8, 64, 64), (3, 4, 4), (6, 0, 100)])
def test_received_view_matches_torch(k, first, num_local):
    g = torch.Generator().manual_seed(k)
    n = 1000
    ids = torch.randint(-1, 256, (n, k), generator=g)
    w = torch.rand(n, k, generator=g)
    meta = torch.cat([ids.int(), w.view(torch.int32)], 1)
    got = [t.cpu() for t in received_view(meta.cuda(), first, num_local)]
    local = (ids >= first) & (ids < first + num_local)
    assert torch.equal(got[0], torch.where(local, ids, -1))
    assert torch.equal(got[1], torch.where(local, w, 0.0))
    ref = torch.bincount((ids - first)[local], minlength=num_local)
    assert torch.equal(got[2], ref) and got[2].sum() > 0
