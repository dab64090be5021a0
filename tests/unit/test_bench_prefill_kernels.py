"""bench.prefill_kernels on CPU (Triton's interpreter, tiny shapes, a stand-in timer): every
attention tile and MoE config it would time on the GPU computes what torch computes, the rows
carry the FLOP count, and the padding share is the expert blocks' count."""

from __future__ import annotations

import pytest
import torch

from moeserve.bench import prefill_kernels as pk

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter case")


def test_pad_share_counts_the_expert_blocks():
    ids = torch.tensor([[0, 1], [0, 2], [0, 1], [3, 0]])  # counts 4, 2, 1, 1 over 8 pairs
    assert pk.pad_share(ids, 4, 4) == pytest.approx(16 / 8 - 1)  # 4 + 4 + 4 + 4 rows
    assert pk.pad_share(ids, 4, 2) == pytest.approx(10 / 8 - 1)  # 4 + 2 + 2 + 2
    assert pk.pad_share(ids, 5, 1) == 0.0  # an expert with no pairs takes no block


def test_attention_tiles_agree_with_torch(monkeypatch):
    monkeypatch.setattr(pk, "_time_ms", lambda fn: 2.0)
    rows: list[dict] = []
    pk.bench_attention(70, 9, 1e12, rows, heads=4, kv_heads=2, d=16, device="cpu",
                       dtype=torch.float32)
    assert [(r["block_m"], r["block_n"], r["warps"], r["split_causal"]) for r in rows] == [
        (*t[:3], t[4]) for t in pk.ATTENTION_TILES]
    pairs = 70 * 9 + 70 * 71 / 2
    assert rows[0]["tflops"] == pytest.approx(4 * pairs * 4 * 16 / 2e-3 / 1e12)


def test_sdpa_rows_run_the_runtime_path_and_agree_with_torch(monkeypatch):
    """A fresh prompt adds the SDPA rows after the tiles (attention/sdpa_prefill.py, by backend,
    GQA as such and repeated); a row is kept only if it matches the masked-SDPA reference. CPU
    torch has FlashAttention and the math kernel, not cuDNN or the memory-efficient one."""
    monkeypatch.setattr(pk, "_time_ms", lambda fn: 2.0)
    monkeypatch.setattr(pk, "_sync", lambda: None)
    rows: list[dict] = []
    pk.bench_attention(70, 0, 1e12, rows, heads=4, kv_heads=2, d=16, device="cpu",
                       dtype=torch.float32)
    sdpa = [r["variant"] for r in rows if r["kernel"] == "sdpa"]
    assert sdpa == ["auto gqa", "auto repeated kv", "flash gqa", "flash repeated kv"]
    assert len(rows) == len(pk.ATTENTION_TILES) + len(sdpa)


def test_moe_configs_agree_with_torch(monkeypatch, capsys):
    def cpu_inputs(t, e, h, i, k, dtype, seed=0):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(t, h, generator=g)
        w13 = torch.randn(e, 2 * i, h, generator=g) / h**0.5
        w2 = torch.randn(e, h, i, generator=g) / i**0.5
        logits, ids = torch.randn(t, e, generator=g).topk(k, dim=1)
        return x, w13, w2, ids, logits.softmax(1)

    monkeypatch.setattr("moeserve.tools.tune_moe.random_inputs", cpu_inputs)
    monkeypatch.setattr(pk, "_time_ms", lambda fn: 1.0)
    monkeypatch.setattr(pk, "PREFILL_SPACE", [(16, 32, 32, 1, 4, 2),
                                              (32, 32, 32, 8, 4, 2, (32, 32, 1, 4, 2))])
    # swap-AB gated GEMM, the down GEMM's own SWAP_AB 0
    monkeypatch.setattr(pk, "SWAP_SPACE", [(16, 32, 32, 1, 4, 2, 1, (32, 32, 1, 4, 2, 0))])
    rows: list[dict] = []
    pk.bench_moe(40, 1e12, rows, e=8, h=64, i=32, k=2)
    assert [r["source"] for r in rows] == ["heuristic", "today, TMA", "space", "space",
                                           "swap space"]
    assert [r["swap_ab"] for r in rows] == [0, 0, 0, 0, 1]
    assert [r["today"] for r in rows] == [True, False, False, False, False]  # no table on CPU
    assert rows[1]["config"] == dict(rows[0]["config"], B_TMA=1, num_stages=4)
    out = capsys.readouterr().out
    assert "skipped" not in out
    assert "swap-AB at 40 tokens: best 16x32x32 g1 w4 s2 swap down 32x32 w4 s2 1.000 ms" in out
    assert rows[2]["tflops"] == pytest.approx(6 * 40 * 2 * 64 * 32 / 1e-3 / 1e12)
    pk.bench_moe(40, 1e12, rows, e=8, h=64, i=32, k=2, space="swap")  # PREFILL_SPACE left out
    assert [r["source"] for r in rows[5:]] == ["heuristic", "today, TMA", "swap space"]


def test_moe_rows_time_todays_tma_tiles_against_pointer_loads(monkeypatch, capsys):
    """Where today's config reads weights by TMA (B_TMA), the same tiles through pointer loads
    get their own row, and the labels say which is which."""
    def cpu_inputs(t, e, h, i, k, dtype, seed=0):
        g = torch.Generator().manual_seed(seed)
        x, w13 = torch.randn(t, h, generator=g), torch.randn(e, 2 * i, h, generator=g) / h**0.5
        logits, ids = torch.randn(t, e, generator=g).topk(k, dim=1)
        return x, w13, torch.randn(e, h, i, generator=g) / i**0.5, ids, logits.softmax(1)

    today = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=32, GROUP_SIZE_M=1,
                 num_warps=4, num_stages=2, B_TMA=1, down=dict(BLOCK_SIZE_N=32, B_TMA=1))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr("moeserve.tools.tune_moe.random_inputs", cpu_inputs)
    monkeypatch.setattr("moeserve.kernels.triton.moe_config.get_moe_config",
                        lambda *a, **k: today)
    monkeypatch.setattr(pk, "_time_ms", lambda fn: 1.0)
    monkeypatch.setattr(pk, "PREFILL_SPACE", [])
    monkeypatch.setattr(pk, "SWAP_SPACE", [])
    rows: list[dict] = []
    pk.bench_moe(40, 1e12, rows, e=8, h=64, i=32, k=2)
    assert [r["source"] for r in rows] == ["heuristic", "today", "today, pointer loads"]
    assert "B_TMA" not in rows[2]["config"] and "B_TMA" not in rows[2]["config"]["down"]
    out = capsys.readouterr().out
    assert "| 16x32x32 g1 w4 s2 tma down 32x32 w4 s2 tma | today |" in out
    assert "| 16x32x32 g1 w4 s2 down 32x32 w4 s2 | today, pointer loads |" in out


def test_swap_table_is_today_with_the_best_swap_rows(tmp_path):
    """--swap-table: the heuristic's table here (no shipped one for this shape), the benched
    token counts' entries replaced by their fastest swap-AB rows; it loads as a table."""
    from moeserve.kernels.triton import moe_config

    def row(t, ms, swap, n):
        cfg = dict(pk._config((16, n, 32, 1, 4, 2, swap)))
        return {"kernel": "fused_moe", "tokens": t, "swap_ab": swap, "ms": ms, "config": cfg}

    rows = [row(40, 1.0, 0, 32), row(40, 2.0, 1, 32), row(40, 1.5, 1, 64), row(900, 3.0, 0, 32)]
    assert pk.write_swap_table(rows[3:], str(tmp_path), 8, 64, 32, 2, torch.float32) is None
    path = pk.write_swap_table(rows, str(tmp_path), 8, 64, 32, 2, torch.float32)
    assert path.name == moe_config.config_file_name(8, 64, 32, torch.float32)
    table = moe_config.load_table(str(path))
    assert table[40] == rows[2]["config"] and table[40]["SWAP_AB"] == 1
    assert sorted(table) == sorted([2 ** j for j in range(14)] + [40])
    assert table[1024] == moe_config.default_config(8, 64, 32, 2, torch.float32, 1024)
