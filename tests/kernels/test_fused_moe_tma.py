"""Weight tiles through TMA descriptors in the fused MoE's grouped GEMMs (`B_TMA` in a launch
config; kernels/triton/tma.py): the float64 per-expert reference of test_fused_moe.py with
partial N and K tiles (TMA's zero fill, gate tiles running into up rows), swap-AB tiles, an
expert-parallel shard with stray ids, the flag reaching each launch from a tuned table, and the
pointer path where a descriptor cannot apply. FP8 experts: test_fp8_emulation.py; bad values:
test_fused_moe_swap.py's flag test. On the CPU the interpreter runs the descriptors (float32);
on an H100 the TMA and pointer paths give the same bits."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("triton")
from test_fused_moe import (DEVICE, SMALL, TOL, LaunchSpy, _check, _inputs,  # noqa: E402
                            poisoned_buffers)  # noqa: F401

from moeserve.kernels.triton import fused_moe as fm  # noqa: E402
from moeserve.kernels.triton import moe_config  # noqa: E402
from moeserve.kernels.triton import tma  # noqa: E402

TILE = dict(SMALL, BLOCK_SIZE_N=16, BLOCK_SIZE_K=16)
pytestmark = pytest.mark.skipif(tma.TensorDescriptor is None, reason="Triton without TMA")


@pytest.fixture
def spy(monkeypatch):
    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # where tma_ok lets CPU tensors through
    s = LaunchSpy(fm._moe_gemm_kernel, "B_TMA", "SWAP_AB")
    monkeypatch.setattr(fm, "_moe_gemm_kernel", s)
    return s


@pytest.mark.parametrize("t,k,h,i,cfg,want", [
    # both GEMMs (down inherits); H 40 and I 24: partial K tiles, and gate tiles of 16 rows over
    # I 24 whose second one reads 8 up rows (computed, never stored)
    (7, 3, 40, 24, dict(TILE, B_TMA=1), [(1, 0), (1, 0)]),
    # the gated GEMM alone, swapped tiles ([BN, BK] as the descriptor stores them)
    (20, 2, 32, 48, dict(TILE, B_TMA=1, SWAP_AB=1, down=dict(B_TMA=0, SWAP_AB=0)),
     [(1, 1), (0, 0)]),
    # the down GEMM alone, 32-token blocks and a wider tile
    (20, 4, 48, 40, dict(TILE, BLOCK_SIZE_M=32, down=dict(B_TMA=1, BLOCK_SIZE_N=32)),
     [(0, 0), (1, 0)]),
])
def test_tma_matches_float64_reference(t, k, h, i, cfg, want, poisoned_buffers, spy):
    x, w13, w2, ids, w = _inputs(t, h, i, 8, k, seed=t + k)
    out = fm.fused_moe(x, w13, w2, ids, w, config=cfg, small_path=False)
    _check(out, x, w13, w2, ids, w)
    assert spy.launches == want
    plain = fm.fused_moe(x, w13, w2, ids, w, config=TILE | {"BLOCK_SIZE_M": cfg["BLOCK_SIZE_M"]},
                         small_path=False)
    torch.testing.assert_close(out, plain, **TOL)


def test_tma_expert_parallel_shard_with_stray_ids(poisoned_buffers, spy):
    """Ids outside [first, first + num_local) contribute 0; the descriptor spans local experts."""
    x, w13, w2, ids, w = _inputs(11, 32, 40, 16, 3, seed=2, first=3, num_local=5, stray=True)
    out = fm.fused_moe(x, w13, w2, ids, w, first_expert=3, num_local=5,
                       config=dict(TILE, B_TMA=1), small_path=False)
    _check(out, x, w13, w2, ids, w, first=3)
    assert spy.launches == [(1, 0), (1, 0)]


def test_pointer_loads_where_no_descriptor_applies(poisoned_buffers, spy):
    """Rows of 30 float32 (120 bytes) break TMA's 16-byte stride rule: the same launch config
    falls back to pointer loads for that GEMM (the gate/up one reads rows of H = 30), and the
    result is still right."""
    x, w13, w2, ids, w = _inputs(9, 30, 32, 8, 2, seed=4)
    if DEVICE == "cuda":
        x, w13, w2 = x.float(), w13.float(), w2.float()
    _check(fm.fused_moe(x, w13, w2, ids, w, config=dict(TILE, B_TMA=1), small_path=False),
           x, w13, w2, ids, w)
    assert spy.launches == [(0, 0), (1, 0)]
    assert not tma.tma_ok(w13.view(-1, 30), interpreted=True)
    assert not tma.tma_ok(w13[:, :, :16].reshape(-1, 16).t(), interpreted=True)  # column stride


def test_cpu_tensors_only_under_the_interpreter(monkeypatch):
    w = torch.zeros(64, 64)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert tma.tma_ok(w, interpreted=True) and not tma.tma_ok(w)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not tma.tma_ok(w, interpreted=True)


def test_table_with_b_tma_reaches_the_launches(tmp_path, spy):
    """A tuned table's B_TMA (top level and in `down`) is read and launched."""
    table = {"4": TILE, "16": dict(TILE, B_TMA=1, down=dict(B_TMA=0, BLOCK_SIZE_N=32))}
    name = moe_config.config_file_name(8, 32, 24, torch.float32)
    (tmp_path / name).write_text(json.dumps(table))
    get = lambda t: moe_config.get_moe_config(8, 32, 24, 2, torch.float32, t, str(tmp_path))  # noqa: E731
    assert "B_TMA" not in get(3) and moe_config.b_tma(get(3)) == 0  # absent: off
    cfg = get(15)
    assert cfg == table["16"] and moe_config.b_tma(moe_config.down_config(cfg)) == 0
    x, w13, w2, ids, w = _inputs(15, 32, 24, 8, 2, seed=6)
    _check(fm.fused_moe(x, w13, w2, ids, w, config=cfg, small_path=False), x, w13, w2, ids, w)
    assert spy.launches == [(1, 0), (0, 0)]


@pytest.mark.gpu
@pytest.mark.parametrize("t", [300, 2048])
@pytest.mark.parametrize("tile", [(128, 128, 64, 8, 4), (64, 128, 64, 4, 4),
                                  (128, 128, 64, 8, 4, 256)])
def test_gpu_tma_equals_pointer_loads_in_bf16(t, tile, spy):
    """On an sm90 GPU the descriptor path stages the same tiles: the same bits as pointer loads
    (Qwen3's E 128 and top-8 at smaller H / I, partial K tiles in the down GEMM), and float64.
    The third tile is the shipped 4096-token one: a 256-column down tile. (The gated GEMM cannot
    take 128x256x64 at 3 stages on sm90 by either path: Triton keeps a buffer per stage, 3 x 80 KB
    of 227 KB.)"""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs sm90+")
    bm, bn, bk, warps, stages = tile[:5]
    cfg = dict(BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk, GROUP_SIZE_M=8,
               num_warps=warps, num_stages=stages)
    if len(tile) > 5:
        cfg["down"] = dict(cfg, BLOCK_SIZE_N=tile[5])
        del cfg["down"]["BLOCK_SIZE_M"]
    x, w13, w2, ids, w = _inputs(t, 512, 352, 128, 8, seed=t)
    out = fm.fused_moe(x, w13, w2, ids, w, config=dict(cfg, B_TMA=1), small_path=False)
    assert spy.launches == [(1, 0), (1, 0)]
    assert torch.equal(out, fm.fused_moe(x, w13, w2, ids, w, config=cfg, small_path=False))
    _check(out, x, w13, w2, ids, w)
