"""Swap-AB tiles of the fused MoE's grouped GEMMs (`SWAP_AB` in a launch config: the kernel
computes [BLOCK_SIZE_N, BLOCK_SIZE_M] = weights @ tokens^T) against the float64 per-expert
reference of test_fused_moe.py: gated and down GEMMs each on or off, partial N and K tiles,
expert-parallel shards with stray ids, a tuned table carrying the key (the flag reaching each
launch), and bad values of either flag (SWAP_AB, B_TMA) refused. The FP8 variant is checked
against its float64 emulation in test_fp8_emulation.py. Tiny shapes: the interpreter pays per
program."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("triton")
from test_fused_moe import (SMALL, TOL, LaunchSpy, _check, _inputs,  # noqa: E402
                            poisoned_buffers)  # noqa: F401

from moeserve.kernels.triton import fused_moe as fm  # noqa: E402
from moeserve.kernels.triton import moe_config  # noqa: E402

TILE = dict(SMALL, BLOCK_SIZE_N=16, BLOCK_SIZE_K=16)  # 16: tl.dot's least width either way


@pytest.mark.parametrize("t,k,h,i,cfg,want", [
    # both GEMMs swapped (down inherits); H 40 and I 24: partial N and K tiles in each GEMM
    (7, 3, 40, 24, dict(TILE, SWAP_AB=1), [1, 1]),
    # gated GEMM swapped, down not (its own, wider tile)
    (20, 2, 32, 48, dict(TILE, SWAP_AB=1, down=dict(SWAP_AB=0, BLOCK_SIZE_N=32)), [1, 0]),
    # down alone swapped, 32-token blocks (the MMA's N side 32)
    (20, 4, 48, 40, dict(TILE, BLOCK_SIZE_M=32, down=dict(SWAP_AB=1, BLOCK_SIZE_N=32)), [0, 1]),
])
def test_swap_ab_matches_float64_reference(t, k, h, i, cfg, want, poisoned_buffers,
                                           monkeypatch):
    spy = LaunchSpy(fm._moe_gemm_kernel, "SWAP_AB", "BLOCK_SIZE_M", "BLOCK_SIZE_N")
    monkeypatch.setattr(fm, "_moe_gemm_kernel", spy)
    x, w13, w2, ids, w = _inputs(t, h, i, 8, k, seed=t + k)
    _check(fm.fused_moe(x, w13, w2, ids, w, config=cfg, small_path=False), x, w13, w2, ids, w)
    assert [s for s, _, _ in spy.launches] == want


def test_swap_ab_expert_parallel_shard_with_stray_ids(poisoned_buffers):
    """Ids outside [first, first + num_local) (other ranks', negative, >= E) contribute 0."""
    x, w13, w2, ids, w = _inputs(11, 32, 40, 16, 3, seed=2, first=3, num_local=5, stray=True)
    cfg = dict(TILE, SWAP_AB=1)
    out = fm.fused_moe(x, w13, w2, ids, w, first_expert=3, num_local=5, config=cfg,
                       small_path=False)
    _check(out, x, w13, w2, ids, w, first=3)
    plain = fm.fused_moe(x, w13, w2, ids, w, first_expert=3, num_local=5, config=TILE,
                         small_path=False)
    torch.testing.assert_close(out, plain, **TOL)  # swap on and off agree


def test_table_with_swap_ab_reaches_the_launches(tmp_path, monkeypatch):
    """A tuned table's SWAP_AB (top level and in `down`) is read, copied and launched."""
    down = dict(BLOCK_SIZE_N=32, BLOCK_SIZE_K=16, GROUP_SIZE_M=1, num_warps=4, num_stages=2,
                SWAP_AB=0)
    table = {"4": TILE, "16": dict(TILE, SWAP_AB=1, down=down)}
    name = moe_config.config_file_name(8, 32, 24, torch.float32)
    (tmp_path / name).write_text(json.dumps(table))
    get = lambda t: moe_config.get_moe_config(8, 32, 24, 2, torch.float32, t, str(tmp_path))  # noqa: E731
    assert "SWAP_AB" not in get(3) and moe_config.swap_ab(get(3)) == 0  # absent: off
    cfg = get(15)
    assert cfg == table["16"] and moe_config.down_config(cfg)["SWAP_AB"] == 0
    spy = LaunchSpy(fm._moe_gemm_kernel, "SWAP_AB", "BLOCK_SIZE_M", "BLOCK_SIZE_N")
    monkeypatch.setattr(fm, "_moe_gemm_kernel", spy)
    x, w13, w2, ids, w = _inputs(15, 32, 24, 8, 2, seed=6)
    _check(fm.fused_moe(x, w13, w2, ids, w, config=cfg, small_path=False), x, w13, w2, ids, w)
    assert spy.launches == [(1, 16, 16), (0, 16, 32)]
    # JSON booleans are the same flags
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / name).write_text(json.dumps({"8": dict(TILE, SWAP_AB=True)}))
    assert moe_config.get_moe_config(8, 32, 24, 2, torch.float32, 8,
                                     str(tmp_path / "b"))["SWAP_AB"] == 1


@pytest.mark.parametrize("key", ["SWAP_AB", "B_TMA"])  # the launch configs' flags
@pytest.mark.parametrize("bad", [2, -1, "1", 1.0, None])
@pytest.mark.parametrize("where", ["top", "down"])
def test_bad_flag_refused(key, bad, where, tmp_path):
    cfg = dict(TILE, **{key: bad}) if where == "top" else dict(TILE, down={key: bad})
    name = moe_config.config_file_name(8, 32, 24, torch.float32)
    (tmp_path / name).write_text(json.dumps({"16": cfg}))
    msg = "down config" if where == "down" else "config for 16 tokens"
    with pytest.raises(ValueError, match=f"{msg}.*{key} must be 0 or 1"):
        moe_config.get_moe_config(8, 32, 24, 2, torch.float32, 16, str(tmp_path))
    x, w13, w2, ids, w = _inputs(5, 32, 24, 8, 2, seed=1)
    with pytest.raises(ValueError, match=f"{key} must be 0 or 1"):  # a config passed directly
        fm.fused_moe(x, w13, w2, ids, w, config=cfg, small_path=False)


def test_defaults_leave_swap_ab_off():
    """Until a GPU measures it, the heuristic and the shipped tables never swap."""
    for t in (1, 64, 1344, 4096):
        assert "SWAP_AB" not in moe_config.default_config(128, 2048, 768, 8, torch.bfloat16, t)
    for path in moe_config.SHIPPED_DIR.glob("*.json"):
        for cfg in moe_config.load_table(str(path)).values():
            assert moe_config.swap_ab(moe_config.down_config(cfg)) == moe_config.swap_ab(cfg) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("t", [64, 1344])
@pytest.mark.parametrize("tile", [(16, 128, 64, 4), (32, 128, 64, 4), (64, 128, 64, 8),
                                  (32, 256, 64, 8), (16, 256, 64, 8)])
def test_gpu_swap_ab_bf16_tiles(t, tile):
    """The tune space's swap-AB tiles compile and agree with float64 in bf16 (Qwen3-like E 128,
    top-8 at smaller H / I), the down GEMM swapped too."""
    bm, bn, bk, warps = tile
    cfg = dict(BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk, GROUP_SIZE_M=8,
               num_warps=warps, num_stages=3, SWAP_AB=1)
    x, w13, w2, ids, w = _inputs(t, 512, 384, 128, 8, seed=t)
    _check(fm.fused_moe(x, w13, w2, ids, w, config=cfg, small_path=False), x, w13, w2, ids, w)
