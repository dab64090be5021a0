"""The NIXL KVTransfer backend (disaggregation.transfer_backend=nixl) between two real agents in
this process over UCX: KV slots land byte for byte, nothing else changes. NIXL is optional and
large (~240 MB with nixl-cu12), so it is not in the test extra: these tests skip, saying so, where
it is not installed."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("nixl._api", reason="NIXL is not installed (optional: `pip install nixl`)")


def test_nixl_moves_kv_slots_between_agents():
    from moeserve.config import DisaggregationConfig
    from moeserve.disaggregation.factory import make_transfer
    from moeserve.disaggregation.regions import KVRegions

    cfg = DisaggregationConfig(transfer_backend="nixl")
    a, b = make_transfer(cfg, "cpu"), make_transfer(cfg, "cpu")
    assert a.name == "nixl" and a.address != b.address
    # MHA-like: K and V per layer (64 B per slot), two layers; MLA-like would be one buffer each
    src = [torch.randn(32, 2, 8) for _ in range(4)]
    dst = [torch.zeros(32, 2, 8) for _ in range(4)]
    for t in src:
        a.register(t.data_ptr(), t.nbytes)
    for t in dst:
        b.register(t.data_ptr(), t.nbytes)
    dst_ptrs = [t.data_ptr() for t in dst]
    s_slots, d_slots = [3, 4, 5, 20, 9, 10], [11, 12, 13, 14, 15, 16]
    ranges = KVRegions.of(src).byte_ranges(s_slots, dst_ptrs, d_slots)
    assert len(ranges[0]) == 3 * 4  # three source runs per buffer
    a.write(b.address, *ranges)
    for s, d in zip(src, dst):
        assert torch.equal(d[d_slots], s[s_slots])
        assert not d[:11].any() and not d[17:].any()
    # a second write reuses the peer's metadata; the other direction works too
    a.write(b.address, *KVRegions.of(src).byte_ranges([30], dst_ptrs, [1]))
    b.write(a.address, *KVRegions.of(dst).byte_ranges([11], [t.data_ptr() for t in src], [0]))
    for s, d in zip(src, dst):
        assert torch.equal(d[1], s[30]) and torch.equal(s[0], d[11])
    a.close()
    b.close()
