"""PD disaggregation's pieces without servers: config errors name their key, slot runs and byte
ranges, the bootstrap route table, and a real Mooncake write between two engines (its bytes
compared with the source)."""

from __future__ import annotations

import pytest
import torch

from moeserve.config import ConfigError, compose
from moeserve.disaggregation.regions import KVRegions, slot_runs


@pytest.mark.parametrize("override,key", [
    ("disaggregation.mode=both", "disaggregation.mode"),
    ("disaggregation.transfer_backend=ucx", "disaggregation.transfer_backend"),
    ("disaggregation.bootstrap_port=70000", "disaggregation.bootstrap_port"),
    ("disaggregation.waiting_timeout_s=0", "disaggregation.waiting_timeout_s"),
    ("disaggregation.heartbeat_max_failures=0", "disaggregation.heartbeat_max_failures"),
])
def test_config_errors_name_the_key(override, key):
    with pytest.raises(ConfigError) as e:
        compose(["disaggregation=decode", override])
    assert e.value.key == key


def test_bootstrap_port_must_differ_from_the_http_port():
    with pytest.raises(ConfigError) as e:
        compose(["disaggregation=prefill", "server.port=8998"])
    assert e.value.key == "disaggregation.bootstrap_port"


def test_slot_runs_and_byte_ranges():
    assert slot_runs([5, 6, 7, 9], [1, 2, 3, 4]) == [(5, 1, 3), (9, 4, 1)]
    bufs = [torch.zeros(16, 2, 4), torch.zeros(16, 1, 8)]  # 32 bytes per slot each
    regions = KVRegions.of(bufs)
    assert regions.slot_bytes == [32, 32]
    src, dst, lens = regions.byte_ranges([5, 6, 9], [1000, 2000], [1, 2, 3])
    base = [b.data_ptr() for b in bufs]
    assert src == [base[0] + 160, base[0] + 288, base[1] + 160, base[1] + 288]
    assert dst == [1032, 1096, 2032, 2096] and lens == [64, 32, 64, 32]
    assert regions.compatible([32, 32]) is None and "differ" in regions.compatible([32])


def test_mooncake_moves_kv_slots_between_engines():
    """Two engines in this process over TCP: slots 3..5 of one pool land in slots 7..9 of the
    other, byte for byte, and nothing else changes."""
    from pd_support import require_mooncake

    require_mooncake()
    from moeserve.config import DisaggregationConfig
    from moeserve.disaggregation.mooncake import MooncakeTransfer

    cfg = DisaggregationConfig(protocol="tcp")
    a, b = MooncakeTransfer(cfg), MooncakeTransfer(cfg)
    src = [torch.randn(12, 2, 8) for _ in range(3)]
    dst = [torch.zeros(12, 2, 8) for _ in range(3)]
    for t in src:
        a.register(t.data_ptr(), t.nbytes)
    for t in dst:
        b.register(t.data_ptr(), t.nbytes)
    ranges = KVRegions.of(src).byte_ranges([3, 4, 5], [t.data_ptr() for t in dst], [7, 8, 9])
    a.write(b.address, *ranges)
    for s, d in zip(src, dst):
        assert torch.equal(d[7:10], s[3:6]) and not d[:7].any() and not d[10:].any()
