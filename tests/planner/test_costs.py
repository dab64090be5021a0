"""Kernel-cost tables: the committed H100 table and the CPU writer of bench.op_costs, the
interpolation between points, and where each cost says it came from."""

from __future__ import annotations

import json

import pytest

from moeserve.bench import op_costs
from moeserve.planner.costs import COST_DIR, CostModel, interp, load_table
from moeserve.planner.profiles import load_profile, profile_names


def test_interp_marks_table_points_measured_and_others_interpolated():
    xs, ys = [1.0, 16.0, 256.0], [10.0, 20.0, 400.0]
    assert interp(xs, ys, 16.0) == (20.0, "measured")
    mid, src = interp(xs, ys, 4.0)
    assert src == "interpolated" and 10.0 < mid < 20.0
    assert interp(xs, ys, 0.5) == (10.0, "interpolated")  # below the table: the launch floor
    assert interp(xs, ys, 512.0)[0] == pytest.approx(800.0)  # above: linear in the size


def test_committed_h100_table_is_versioned_and_covers_every_family():
    table = load_table(f"{COST_DIR}/h100.json")
    assert table["schema"] == op_costs.SCHEMA and "H100" in table["device"]
    assert {"gemm", "bmm", "moe", "attn_decode", "attn_extend", "norm", "router"} <= set(
        table["ops"])
    assert table["peaks"]["bf16_tflops"] > 500  # a Hopper GPU, not a smoke table


def test_a_measured_point_is_returned_as_measured():
    c = CostModel(load_profile("h100"))
    row = next(r for r in c.rows("gemm", dtype="bf16") if (r["k"], r["n"]) == (2048, 5120))
    cost = c.gemm(row["m"][2], 2048, 5120, "bf16")
    assert cost.source == "measured" and cost.us == row["us"][2]
    assert c.gemm(48, 2048, 5120, "bf16").source == "interpolated"
    assert c.gemm(64, 3000, 5000, "bf16").source == "interpolated"  # a shape not in the table


def test_gpus_without_a_table_scale_the_h100_costs_by_their_sheets():
    h100, gb200, h20 = (CostModel(load_profile(n)) for n in ("h100", "gb200_nvl72", "h20"))
    big = (1, 7168, 36864, "fp8")  # a weight stream: bandwidth-bound
    assert gb200.gemm(*big).source == "scaled"
    assert gb200.gemm(*big).us < h100.gemm(*big).us  # 8 against 3.35 TB/s
    flops = (16384, 7168, 36864, "fp8")  # compute-bound: the H20 has 296 FP8 TFLOP/s
    assert h20.gemm(*flops).us > 5 * h100.gemm(*flops).us
    tiny = gb200.norm(1, 2048)  # launch-bound: no sheet makes a launch cheaper
    assert tiny.us >= min(h100.norm(1, 2048).us, 2.0)


def test_the_h200_is_priced_from_its_own_measured_table():
    h100, h200 = CostModel(load_profile("h100")), CostModel(load_profile("h200"))
    assert h200.table["device"] == "NVIDIA H200" and h100.table["device"] != "NVIDIA H200"
    big = (1, 7168, 36864, "fp8")
    assert h200.gemm(*big).source == "measured"
    assert h200.gemm(*big).us < h100.gemm(*big).us  # a weight stream: more bandwidth


def test_every_shipped_profile_loads_with_its_sources():
    assert {"h100", "h200", "h800", "h20", "gb200_nvl72"} <= set(profile_names())
    for name in profile_names():
        prof = load_profile(name)
        assert set(prof.sources().values()) <= {"spec", "measured"}
        assert prof.cost_table or prof.scale_costs_from


def test_op_costs_cpu_smoke_writes_a_table_the_planner_reads(tmp_path):
    out = tmp_path / "cpu.json"
    op_costs.main(["--device", "cpu", "--smoke", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert doc["schema"] == op_costs.SCHEMA and doc["device"]
    c = CostModel(load_profile("h100"), table_path=str(out))
    cost = c.gemm(4, 64, 128, "fp32")
    row = next(r for r in doc["ops"]["gemm"] if (r["k"], r["n"]) == (64, 128))
    assert cost.source == "measured" and cost.us == row["us"][1]


def test_gemv_moe_is_priced_by_experts_touched_not_tokens_per_expert():
    """The GEMV path (fused_moe_small) streams each touched expert once: with more pairs it can
    only cost more. By tokens per expert, the committed table's points at 1.00 and 1.03 gave a
    batch-1 step 18% less time for 7.76 touched experts than for 8."""
    from moeserve.planner.arch import load_shape

    c, s = CostModel(load_profile("h100")), load_shape("qwen3_30b_a3b")
    row = next(r for r in c.rows("moe", dtype="bf16") if r["model"] == "qwen3_30b_a3b")
    one = c.moe(s, "bf16", row["touched"][0], row["tokens"][0] * row["topk"])
    assert one.source == "measured" and one.us == pytest.approx(row["us"][0])
    costs = [c.moe(s, "bf16", t, min(t * 1.03, 32)).us for t in (7.0, 7.76, 8.0, 12.0, 24.0)]
    assert costs == sorted(costs)
    assert costs[1] == pytest.approx(one.us * 7.76 / 8, rel=0.01)  # below the table: per expert


def test_fresh_gqa_prefill_is_priced_from_the_sdpa_rows_from_the_runtime_threshold(tmp_path):
    """The runtime attends fresh prompts through SDPA from attention.sdpa_prefill_min_tokens new
    tokens a step; the planner prices such steps from the table's SDPA GQA rows, and steps below
    it or with a cached prefix from the Triton kernel's. Each GQA model takes its own row."""
    from moeserve.config_schema import AttentionConfig
    from moeserve.planner.arch import load_shape
    from moeserve.planner.costs import SDPA_MIN_TOKENS

    assert SDPA_MIN_TOKENS == AttentionConfig().sdpa_prefill_min_tokens == 4096
    doc = load_table(f"{COST_DIR}/h100.json")
    ours = {r["model"]: r for r in doc["ops"]["attn_extend"] if r["impl"] == "moeserve"}
    for model in ("qwen3_30b_a3b", "llama3_8b"):  # SDPA rows at a third of the Triton kernel's
        doc["ops"]["attn_extend"].append(dict(ours[model], impl="sdpa",
                                              us=[u / 3 for u in ours[model]["us"]]))
    path = tmp_path / "sdpa.json"
    path.write_text(json.dumps(doc))
    plain, with_sdpa = CostModel(load_profile("h100")), CostModel(load_profile("h100"),
                                                                   table_path=str(path))
    q3, llama = load_shape("qwen3_30b_a3b"), load_shape("llama3_8b")
    fresh = with_sdpa.attn_prefill(q3, 1, 8192, 0)
    assert fresh.us == pytest.approx(plain.attn_prefill(q3, 1, 8192, 0).us / 3)
    assert fresh.source == "measured"
    two = with_sdpa.attn_prefill(q3, 2, 2048, 0)  # two fresh prompts: 4096 new tokens
    assert two.us < 0.5 * plain.attn_prefill(q3, 2, 2048, 0).us
    for args in ((1, 2048, 0), (1, 8192, 512)):  # below the threshold; a cached prefix
        assert with_sdpa.attn_prefill(q3, *args).us == plain.attn_prefill(q3, *args).us
    lrow = with_sdpa.attn_prefill(llama, 1, 8192, 0)  # llama's own 8-KV-head row
    assert lrow.us == pytest.approx(ours["llama3_8b"]["us"][-1] / 3)
