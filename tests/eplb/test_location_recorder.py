"""ExpertLocation (dispatch choice, in-place update, placement.json) and the load recorder."""

from __future__ import annotations

import pytest
import torch

from moeserve.eplb.location import ExpertLocation
from moeserve.eplb.recorder import ExpertDistributionRecorder, load_dump, load_init_placement

# ---- ExpertLocation ----


def test_trivial_placement():
    loc = ExpertLocation.trivial(2, 8, ep_size=4)
    assert loc.physical_to_logical[0].tolist() == list(range(8))
    ids = torch.tensor([[0, 7], [3, 4]])
    assert torch.equal(loc.to_physical(ids, 1), ids)
    red = ExpertLocation.trivial(2, 8, ep_size=4, num_redundant=4)  # 12 slots, 3 per rank
    assert red.physical_to_logical[0].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]
    assert red.logical_count[0].tolist() == [2, 2, 2, 2, 1, 1, 1, 1]
    # rank 2 holds slots 6, 7, 8 = experts 6, 7, 0: it sends expert 0 to its own copy
    assert int(red.for_rank(2).to_physical(torch.tensor([[0]]), 0)) == 8
    assert int(red.for_rank(0).to_physical(torch.tensor([[0]]), 0)) == 0


# 4 ranks x 2 slots, 2 nodes: rank0 [e0 e1] rank1 [e0 e2] | rank2 [e3 e1] rank3 [e2 e3]
HAND_PHY2LOG = torch.tensor([[0, 1, 0, 2, 3, 1, 2, 3]])
HAND_TABLES = {  # rank -> slot chosen for experts 0..3 (e0: 0 2, e1: 1 5, e2: 3 6, e3: 4 7)
    0: [0, 1, 3, 4],  # e2: same node (rank 1, slot 3); e3 only on node 1: 0 % 2 -> slot 4
    1: [2, 1, 3, 7],  # local e0, e2; e1 on the node; e3: 1 % 2 -> slot 7
    2: [0, 5, 6, 4],  # e0 only on node 0: 2 % 2 -> slot 0; e2 on the node (rank 3)
    3: [2, 5, 6, 7],  # e0: 3 % 2 -> slot 2 (spread: rank 2 took slot 0)
}


@pytest.mark.parametrize("rank", range(4))
def test_dispatch_prefers_rank_then_node_then_spreads(rank):
    loc = ExpertLocation.from_physical_to_logical(
        HAND_PHY2LOG, 4, ep_size=4, num_nodes=2, ep_rank=rank
    )
    assert loc.logical_to_rank_dispatch_physical[0].tolist() == HAND_TABLES[rank]
    assert loc.logical_to_all_physical[0, :, :2].tolist() == [[0, 2], [1, 5], [3, 6], [4, 7]]


def test_dispatch_invariants_random_placement():
    gen = torch.Generator().manual_seed(0)
    load = torch.randint(0, 100, (3, 32), generator=gen) ** 2
    base = ExpertLocation.from_algorithm(
        load, ep_size=8, num_nodes=2, num_redundant=8, num_groups=4
    )
    per_rank, per_node = base.slots_per_rank, base.num_physical // 2
    for rank in range(8):
        loc = base.for_rank(rank)
        table = loc.logical_to_rank_dispatch_physical  # [L, E]
        assert torch.equal(
            loc.physical_to_logical.gather(-1, table), torch.arange(32).expand(3, -1)
        )
        for layer in range(3):
            for e in range(32):
                slots = [s for s in loc.logical_to_all_physical[layer, e].tolist() if s >= 0]
                chosen = int(table[layer, e])
                if any(s // per_rank == rank for s in slots):
                    assert chosen // per_rank == rank
                elif any(s // per_node == rank // 4 for s in slots):
                    assert chosen // per_node == rank // 4


def test_to_physical_dtype_and_masked_ids():
    loc = ExpertLocation.from_physical_to_logical(
        HAND_PHY2LOG, 4, ep_size=4, num_nodes=2, ep_rank=3
    )
    ids = torch.tensor([[0, 3], [-1, 2]], dtype=torch.int32)
    out = loc.to_physical(ids, 0)
    assert out.dtype == torch.int32
    assert out.tolist() == [[2, 7], [-1, 6]]


def test_update_in_place_keeps_tensors():
    old = ExpertLocation.trivial(2, 8, ep_size=4, num_redundant=4, ep_rank=1)
    ptrs = [old.physical_to_logical.data_ptr(), old.logical_to_rank_dispatch_physical.data_ptr()]
    load = torch.tensor([[1, 1, 1, 1, 1, 1, 90, 80]] * 2)
    new = ExpertLocation.from_algorithm(load, ep_size=4, num_redundant=4)  # seen from rank 0
    old.update_(new)
    assert ptrs == [
        old.physical_to_logical.data_ptr(),
        old.logical_to_rank_dispatch_physical.data_ptr(),
    ]
    assert torch.equal(old.physical_to_logical, new.physical_to_logical)
    assert torch.equal(
        old.logical_to_rank_dispatch_physical, new.for_rank(1).logical_to_rank_dispatch_physical
    )
    assert old.metadata["source"] == "eplb"
    bigger = ExpertLocation.trivial(2, 8, ep_size=4, num_redundant=8)
    before = old.physical_to_logical.clone()
    with pytest.raises(ValueError):
        old.update_(bigger)
    assert torch.equal(old.physical_to_logical, before)


def test_placement_json_round_trip(tmp_path):
    load = torch.randint(0, 50, (3, 16), generator=torch.Generator().manual_seed(3))
    loc = ExpertLocation.from_algorithm(load, ep_size=4, num_nodes=2, num_redundant=4, num_groups=4)
    path = tmp_path / "placement.json"
    loc.save(str(path), metadata={"model": "tiny"})
    back = ExpertLocation.load(str(path), ep_rank=2)
    assert back.metadata["model"] == "tiny" and back.metadata["num_groups"] == 4
    assert (back.ep_size, back.num_nodes, back.ep_rank) == (4, 2, 2)
    for name in ("physical_to_logical", "logical_to_all_physical", "logical_count"):
        assert torch.equal(getattr(back, name), getattr(loc, name))
    assert torch.equal(
        back.logical_to_rank_dispatch_physical, loc.for_rank(2).logical_to_rank_dispatch_physical
    )


# ---- recorder ----


def _routing(gen: torch.Generator, tokens: int, k: int, experts: int) -> torch.Tensor:
    return torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)])


def test_stat_counts_match_host_bincount():
    gen = torch.Generator().manual_seed(0)
    rec = ExpertDistributionRecorder(num_layers=3, num_physical=12)
    rec.record(0, torch.tensor([[1, 2]]))  # not started: ignored
    rec.start()
    ref = torch.zeros(3, 12, dtype=torch.int64)
    for _ in range(4):
        for layer in range(3):
            ids = _routing(gen, 7, 3, 12)
            rec.record(layer, ids)
            ref[layer] += torch.bincount(ids.flatten(), minlength=12)
        rec.step()
    rec.record(1, torch.tensor([[-1, 5]]))  # masked id ignored
    ref[1, 5] += 1
    assert torch.equal(rec.physical_counts(), ref)
    assert rec.steps == 4 and rec.topk == 2
    rec.reset()
    assert int(rec.physical_counts().sum()) == 0 and rec.steps == 0


def test_per_pass_keeps_last_window():
    rec = ExpertDistributionRecorder(num_layers=1, num_physical=4, mode="per_pass", window=2)
    rec.start()
    for p in range(5):  # pass p routes one token to expert p % 4, p + 1 times
        rec.record(0, torch.full((p + 1, 1), p % 4))
        rec.step()
    # passes 3 and 4 remain: expert 3 x4, expert 0 x5
    assert rec.physical_counts().tolist() == [[5, 0, 0, 4]]
    rec.record(0, torch.tensor([[1]]))  # the open pass counts too
    assert rec.physical_counts().tolist() == [[5, 1, 0, 4]]


def test_logical_ids_are_mapped_and_folded_back():
    loc = ExpertLocation.from_physical_to_logical(
        HAND_PHY2LOG, 4, ep_size=4, num_nodes=2, ep_rank=3
    )
    rec = ExpertDistributionRecorder(1, 8, location=loc, input_space="logical")
    rec.start()
    ids = torch.tensor([[0, 1], [2, 3], [0, 3]])
    rec.record(0, ids)
    # rank 3 sends e0 -> slot 2, e1 -> 5, e2 -> 6, e3 -> 7
    assert rec.physical_counts().tolist() == [[0, 0, 2, 0, 0, 1, 1, 2]]
    assert rec.logical_load().tolist() == [torch.bincount(ids.flatten(), minlength=4).tolist()]


def test_dump_load_round_trip(tmp_path):
    loc = ExpertLocation.trivial(2, 6, ep_size=2, num_redundant=2)
    rec = ExpertDistributionRecorder(2, 8, mode="per_pass", window=4, location=loc)
    rec.start()
    rec.record(0, torch.tensor([[0, 6], [1, 7]]))
    rec.record(1, torch.tensor([[5, 4]]))
    rec.step()
    rec.stop()
    path = tmp_path / "dump.pt"
    written = rec.dump(str(path), metadata={"model": "tiny-v3"})
    back = load_dump(str(path))
    assert torch.equal(back.physical_counts, written.physical_counts)
    assert torch.equal(back.physical_to_logical, loc.physical_to_logical)
    meta = back.metadata
    assert meta["model"] == "tiny-v3" and meta["steps"] == 1 and meta["mode"] == "per_pass"
    assert (meta["num_layers"], meta["num_logical_experts"], meta["num_physical_experts"]) == (
        2,
        6,
        8,
    )
    assert (meta["ep_size"], meta["num_nodes"], meta["topk"]) == (2, 1, 2)
    assert meta["start_time"] <= meta["end_time"]
    # slots 6, 7 hold experts 0, 1 again
    assert back.logical_load().tolist() == [[2, 2, 0, 0, 0, 0], [0, 0, 0, 0, 1, 1]]
    assert torch.equal(back.location().physical_to_logical, loc.physical_to_logical)
    # a dump seeds a placement for another layout; a placement.json only for its own
    init = load_init_placement(str(path), ep_size=4, num_redundant=2, ep_rank=3)
    assert (init.num_physical, init.ep_size, init.ep_rank) == (8, 4, 3)
    assert init.metadata["model"] == "tiny-v3"
    init.save(str(tmp_path / "p.json"))
    again = load_init_placement(str(tmp_path / "p.json"), ep_size=4, num_redundant=2)
    assert torch.equal(again.physical_to_logical, init.physical_to_logical)
    with pytest.raises(ValueError):
        load_init_placement(str(tmp_path / "p.json"), ep_size=2, num_redundant=2)


@pytest.mark.gpu
def test_record_and_map_without_host_sync():
    loc = ExpertLocation.trivial(2, 16, ep_size=4, num_redundant=4, device="cuda")
    rec = ExpertDistributionRecorder(2, 20, mode="per_pass", window=3, location=loc,
                                     input_space="logical", device="cuda")  # fmt: skip
    ids = torch.randint(0, 16, (64, 4), device="cuda")
    rec.start()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            loc.to_physical(ids, 1)
            rec.record(0, ids)
            rec.record(1, ids)
            rec.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert int(rec.physical_counts().sum()) == 3 * 2 * 64 * 4
