"""The Triton copy-to-many kernel of the p2p dispatcher against torch's copy (one GPU: ordinary
device buffers stand in for peer mappings; the two-GPU path runs in scripts/gpu_dp_check.py)."""

from __future__ import annotations

import pytest
import torch

from moeserve.kernels.peer_copy import PeerCopier

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int32])
@pytest.mark.parametrize("rows,row0", [(1, 0), (37, 5), (4096, 4096)])
def test_copy_to_many_matches_torch(dtype, rows, row0):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator(device="cuda").manual_seed(0)
    src = (torch.randn(rows, 7168, device="cuda", generator=g) * 100).to(dtype)
    dsts = [torch.full((8192, 7168), -7, dtype=dtype, device="cuda") for _ in range(3)]
    copier = PeerCopier(dsts)
    assert copier.use_kernel
    copier(src, row0)
    torch.cuda.synchronize()
    for d in dsts:
        assert torch.equal(d[row0 : row0 + rows], src)
        assert (d[:row0] == -7).all() and (d[row0 + rows :] == -7).all()  # nothing else written
