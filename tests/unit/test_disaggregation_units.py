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
    ("disaggregation.staging_mb=-1", "disaggregation.staging_mb"),
    ("disaggregation.router_metrics_port=0", "disaggregation.router_metrics_port"),
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


def test_gather_stage_moves_fragmented_slots_in_chunks():
    """The prefill's gather stage (2 tokens' worth: several chunks) moves fragmented source slots
    into fragmented destination slots byte for byte, one range per destination run and buffer."""
    from pd_support import require_mooncake

    require_mooncake()
    from moeserve.config import DisaggregationConfig
    from moeserve.disaggregation.mooncake import MooncakeTransfer
    from moeserve.disaggregation.staging import GatherStage, dst_runs, run_count

    assert dst_runs([4, 5, 9, 10, 11, 2]) == [(0, 4, 2), (2, 9, 3), (5, 2, 1)]
    assert run_count([4, 5, 9, 10, 11, 2]) == 3 and run_count([]) == 0
    cfg = DisaggregationConfig(protocol="tcp")
    a, b = MooncakeTransfer(cfg), MooncakeTransfer(cfg)
    src = [torch.randn(16, 2, 8), torch.randn(16, 4)]  # 64 and 16 bytes per slot
    dst = [torch.zeros(16, 2, 8), torch.zeros(16, 4)]
    for t in src:
        a.register(t.data_ptr(), t.nbytes)
    for t in dst:
        b.register(t.data_ptr(), t.nbytes)
    stage = GatherStage(src, a, 2 * 80)
    assert stage.capacity == 2
    s_slots, d_slots = [9, 3, 4, 12, 1], [5, 6, 7, 1, 2]
    assert stage.write(a, b.address, s_slots, [t.data_ptr() for t in dst], d_slots) == 5 * 80
    for s, d in zip(src, dst):
        assert torch.equal(d[d_slots], s[s_slots])
        assert not d[[0, 3, 4, *range(8, 16)]].any()
    # runs of 4+ source slots are block-copied (memmove on CPU), not index_select-ed
    wide = GatherStage(src, a, 8 * 80)
    s_slots, d_slots = [*range(2, 6), *range(10, 14)], [15, 14, 13, 12, 11, 10, 9, 8]
    assert wide.write(a, b.address, s_slots, [t.data_ptr() for t in dst], d_slots) == 8 * 80
    for s, d in zip(src, dst):
        assert torch.equal(d[d_slots], s[s_slots])


def test_alloc_contiguous_finds_a_run():
    """A PD decode server's slots: one run where the free list has one (after frees in any
    order), else the lowest free slots; the allocator's count stays right."""
    from moeserve.kvcache.allocator import TokenToKVPoolAllocator

    alloc = TokenToKVPoolAllocator(20)
    taken = alloc.alloc(20)
    alloc.free(taken[[15, 2, 3, 10, 11, 12, 13, 4]])  # free: 3,4,5 | 11..14 | 16
    assert alloc.alloc_contiguous(4).tolist() == [11, 12, 13, 14]
    assert alloc.alloc_contiguous(3).tolist() == [3, 4, 5]
    alloc.free(torch.tensor([8, 1]))
    assert alloc.alloc_contiguous(2).tolist() == [1, 8]  # no run of 2: the lowest two
    assert alloc.available_size() == 1 and alloc.alloc_contiguous(2) is None


def test_alloc_contiguous_best_fit_continuation_and_fewest_runs():
    """The shortest run that fits (not the first), the run right after a chunk when asked, and
    with no run long enough the longest runs first; every slot handed out once."""
    from moeserve.kvcache.allocator import TokenToKVPoolAllocator

    alloc = TokenToKVPoolAllocator(40)
    taken = alloc.alloc(40)
    # free, in an order unlike the addresses: 1..8 | 12..14 | 20..29 | 33
    alloc.free(taken[[32, *range(19, 29), *range(11, 14), *range(8)]])
    assert alloc.alloc_contiguous(3).tolist() == [12, 13, 14]  # best fit, not 1..3
    assert alloc.alloc_contiguous(4, after=20).tolist() == [20, 21, 22, 23]
    assert alloc.alloc_contiguous(2, after=30).tolist() == [24, 25]  # 30 is not free: best fit
    # left: 1..8 (8) | 26..29 (4) | 33 (1); 12 slots take the two longest runs
    assert alloc.alloc_contiguous(12).tolist() == [*range(1, 9), *range(26, 30)]
    assert alloc.alloc_contiguous(1).tolist() == [33] and alloc.available_size() == 0
    alloc.free(torch.tensor([*range(3, 9), 33]))
    assert sorted(alloc.alloc(7).tolist()) == [*range(3, 9), 33]


def test_nixl_backend_missing_names_the_package():
    """transfer_backend=nixl without NIXL installed: the error names the package to install."""
    import importlib.util

    if importlib.util.find_spec("nixl") is not None:
        pytest.skip("NIXL is installed here: tests/unit/test_nixl_transfer.py runs instead")
    from moeserve.config import DisaggregationConfig
    from moeserve.disaggregation.factory import make_transfer
    from moeserve.disaggregation.transfer import TransferBackendMissing

    with pytest.raises(TransferBackendMissing, match="pip install nixl"):
        make_transfer(DisaggregationConfig(transfer_backend="nixl"), "cpu")


@pytest.mark.parametrize("topk,dtype", [(None, torch.float32), (2, torch.bfloat16)])
def test_draft_state_crosses_in_kvdone(topk, dtype):
    """MTP: a prefill row's draft state (d_1, or a tree's first level, and the draft hidden
    state) goes into KVDone, through msgpack, into another decoder's row bit for bit; a decoder
    of another shape refuses it, saying why."""
    from moeserve.disaggregation.messages import DECODER, ENCODER, KVDone
    from moeserve.spec_mtp.decoder import SpecDecoder

    def decoder(k, dt):
        d = SpecDecoder.__new__(SpecDecoder)
        d.next_draft = torch.zeros((6,) if k is None else (6, k), dtype=torch.int64)
        d.hidden = torch.zeros(6, 8, dtype=dt)
        return d

    src, dst = decoder(topk, dtype), decoder(topk, dtype)
    src.next_draft[2] = torch.tensor(7 if topk is None else [7, 9])
    src.hidden[2] = torch.randn(8).to(dtype)
    ids, hidden = src.draft_state(2)
    msg = DECODER.decode(ENCODER.encode(KVDone(room=1, ok=True, draft_tokens=ids,
                                               draft_hidden=hidden)))
    assert dst.set_draft_state(4, msg.draft_tokens, msg.draft_hidden) is None
    assert torch.equal(dst.next_draft[4], src.next_draft[2])
    assert torch.equal(dst.hidden[4], src.hidden[2])
    other = decoder(3, dtype)
    assert "ids" in other.set_draft_state(4, msg.draft_tokens, msg.draft_hidden)
    assert not other.next_draft.any()
