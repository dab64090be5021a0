"""tools.tune_moe's search space without a GPU: every config it can write is one that
`moe_config.load_table` accepts back, the swap-AB tiles are the ones docs/gpu_decode.md names,
and the down GEMM's candidates include the other SWAP_AB."""

from __future__ import annotations

import json

import torch

from moeserve.kernels.triton import moe_config
from moeserve.tools import tune_moe as tm


def test_every_candidate_round_trips_through_a_table(tmp_path):
    configs = [tm.as_config(r) for r in tm.SPACE]
    configs += [c for cfg in configs[:: len(configs) - 1] for c in tm.down_candidates(cfg)]
    table = {str(n): cfg for n, cfg in enumerate(configs, 1)}
    name = moe_config.config_file_name(128, 2048, 768, torch.bfloat16)
    (tmp_path / name).write_text(json.dumps(table))
    loaded = moe_config.load_table(str(tmp_path / name))
    assert [loaded[n] for n in sorted(loaded)] == configs


def test_swap_ab_tiles_in_the_space():
    swaps = [tm.as_config(r) for r in tm.SWAP_SPACE]
    assert all(moe_config.swap_ab(c) == 1 for c in swaps)
    assert {c["BLOCK_SIZE_M"] for c in swaps} == {16, 32, 64}
    assert {c["BLOCK_SIZE_N"] for c in swaps} == {64, 128, 256}
    assert {c["num_warps"] for c in swaps} == {4, 8}
    assert all(r in tm.SPACE for r in tm.SWAP_SPACE)
    quick = [tm.as_config(r) for r in tm.QUICK]
    assert len(quick) == 14 and sum(moe_config.swap_ab(c) for c in quick) == 2
    assert sum(moe_config.swap_ab(tm.as_config(r)) for r in tm.SPACE) == len(tm.SWAP_SPACE)


def test_down_candidates_try_the_other_swap_ab():
    for cfg in (tm.as_config(tm.SPACE[0]), tm.as_config(tm.SWAP_SPACE[0])):
        mine = moe_config.swap_ab(cfg)
        downs = [moe_config.swap_ab(moe_config.down_config(c)) for c in tm.down_candidates(cfg)]
        assert downs == [mine] * len(tm.DOWN_SPACE) + [1 - mine] * len(tm.DOWN_FLIP_SPACE)
    assert "SWAP_AB=1 down: BLOCK_SIZE_N=128" in tm.describe(
        tm.down_candidates(tm.as_config(tm.SWAP_SPACE[0]))[-1])


def test_tma_twins_of_prefill_tiles_round_trip(tmp_path):
    """--tma: prefill-sized tiles (M >= 64, or swap-AB) get B_TMA twins at their stages and one
    more (at most 5); decode tiles do not; down tiles come both ways; a table keeps the flag."""
    base = [tm.as_config(r) for r in ((16, 64, 128, 1, 4, 4), (128, 128, 64, 8, 8, 3),
                                      (64, 64, 64, 8, 4, 5), (32, 128, 64, 8, 4, 4, 1))]
    got = tm.tma_twins(base)
    assert got[:4] == base
    assert [(c["BLOCK_SIZE_M"], c["num_stages"]) for c in got[4:]] == [
        (128, 3), (128, 4), (64, 5), (32, 4), (32, 5)]
    assert all(moe_config.b_tma(c) == 1 for c in got[4:])
    downs = tm.down_candidates(got[4], tma=True)
    flags = [moe_config.b_tma(moe_config.down_config(c)) for c in downs]
    assert flags == [0, 1] * (len(tm.DOWN_SPACE) + len(tm.DOWN_FLIP_SPACE))
    assert "B_TMA=1 down: BLOCK_SIZE_N=32" in tm.describe(downs[1])
    table = {str(n): cfg for n, cfg in enumerate(got + downs, 1)}
    name = moe_config.config_file_name(128, 2048, 768, torch.bfloat16)
    (tmp_path / name).write_text(json.dumps(table))
    loaded = moe_config.load_table(str(tmp_path / name))
    assert [loaded[n] for n in sorted(loaded)] == got + downs
