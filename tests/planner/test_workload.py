"""Balancedness from our EPLB algorithm on the workload's expert popularity: its semantics
(replicas go to hot experts; more slots never hurt), sampling noise, and recorded dumps."""

from __future__ import annotations

import pytest
import torch

from moeserve.eplb import ExpertDump, balancedness, trivial_rank_load
from moeserve.planner.workload import (
    expected_balancedness,
    feasible_redundancy,
    inclusion_rates,
    raw_eplb_balancedness,
    step_balancedness,
)

ZIPF = "zipf:1.0"


@pytest.mark.parametrize("ep,nodes", [(8, 1), (16, 2), (32, 4)])
def test_more_redundant_experts_never_lower_balancedness(ep, nodes):
    values = [expected_balancedness(ZIPF, 256, 8, 8, ep, r, nodes) for r in range(0, 65, 16)
              if (256 + r) % ep == 0]
    assert all(b >= a for a, b in zip(values, values[1:]))
    assert values[-1] > values[0]


def test_eplb_replicas_lift_a_skewed_load():
    # Zipf-skewed routing on 32 GPUs: 8 experts per GPU cannot spread a hot expert; 32
    # replicas go to the hottest experts and most of the skew goes
    without = raw_eplb_balancedness(ZIPF, 256, 8, 8, 32, 0, 4)
    with_32 = raw_eplb_balancedness(ZIPF, 256, 8, 8, 32, 32, 4)
    assert without < 0.5 < 0.8 < with_32


def test_small_steps_balance_worse_than_large_ones():
    # uniform popularity, 8 experts on each of 32 GPUs: only sampling noise unbalances a step
    big = step_balancedness("zipf:0.0", 256, 8, 8, 32, 0, 4, 4096)
    small = step_balancedness("zipf:0.0", 256, 8, 8, 32, 0, 4, 2)
    assert big > 0.97 and small < big - 0.1


def test_trivial_placement_matches_eplb_trivial_rank_load(tmp_path):
    counts = torch.zeros(2, 16, dtype=torch.int64)
    counts[:, 0] = 700  # one hot expert per layer on GPU 0
    counts[:, 1:] = 20
    path = tmp_path / "dump.pt"
    ExpertDump(counts, torch.arange(16).repeat(2, 1), {"num_logical_experts": 16}).save(path)
    rates = inclusion_rates(str(path), 2, 16, 2, 0)
    assert torch.allclose(rates, counts.double() / counts.sum(-1, keepdim=True), atol=1e-9)
    want = float(balancedness(trivial_rank_load(counts.double(), 4)).mean())
    got = step_balancedness(str(path), 16, 2, 1, 4, 0, 1, 1 << 16, eplb=False)
    assert got == pytest.approx(want, abs=0.03)


def test_redundancy_that_divides_no_ep_size_is_refused():
    assert feasible_redundancy(256, 32, 72) == [32]
    with pytest.raises(ValueError, match="divide over ep 72"):
        feasible_redundancy(256, 16, 72)
