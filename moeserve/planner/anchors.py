"""Figures the planner is checked against, each with its source and the settings it was measured
with: our own GPU measurements (docs/) and SGLang's 96xH100 deployment (LMSYS blog,
2025-05-05). `python -m moeserve.planner --check` prints predicted against measured; the tests
hold the targets (own figures +-10%, published ones +-15%)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from moeserve.planner.arch import load_shape
from moeserve.planner.deploy import Deployment, Role
from moeserve.planner.predict import predict
from moeserve.planner.profiles import load_profile
from moeserve.planner.serving import ServingRun, simulate
from moeserve.planner.sweep import cost_model
from moeserve.planner.workload import Workload


@dataclass(frozen=True)
class Anchor:
    name: str
    reference: float
    unit: str
    target: float  # allowed |error| (0.10 = 10%)
    source: str
    predict: Callable[[], float]
    known_miss: str | None = None  # why the planner misses this target today (docs/planner.md)


def _one_gpu_step(model: str, gpu: str, dtype: str, batch: int, context: int,
                  layers: int | None = None) -> Callable[[], float]:
    """bench.one_batch / bench.spec_step: one decode step in a CUDA graph, ms."""
    def run() -> float:
        dep = Deployment(model, gpu, dtype, colocated=Role("colocated", 1, 1, batch=batch))
        return predict(dep, Workload(context, 0), layers=layers).roles[0].step_ms
    return run


def _serving(gpu: str, conc: int) -> Callable[[], float]:
    def run() -> float:
        c = cost_model(gpu, "moeserve")
        s = load_shape("qwen3_30b_a3b")
        return simulate(s, c, Role("colocated", 1, 1), "bf16", ServingRun(2 * conc, conc)
                        ).output_tok_s
    return run


SGLANG_PREFILL = Role("prefill", 4, 8, tbo=True, chunk=16384, redundant=32)
SGLANG_DECODE = Role("decode", 9, 8, tbo=True, batch=256, redundant=32)


def sglang_deployment(**decode) -> Deployment:
    """SGLang's 96xH100 settings (blog + its reproduction issue sgl-project/sglang#6017): FP8
    DeepSeek-V3, DP attention, DeepEP (normal for prefill, low-latency for decode), TBO,
    EPLB with 32 redundant experts; prefill 4 nodes (EP32) at 16,384 tokens per GPU per step,
    decode 9 nodes (EP72) at 256 requests per GPU. Kernels: the best measured or published
    (kernels=best: SDPA MHA-form prefill, FlashMLA decode, grouped GEMMs at dense efficiency)."""
    return Deployment("deepseek_v3", "h100", "fp8", "best", prefill=SGLANG_PREFILL,
                      decode=SGLANG_DECODE.with_(**decode))


def _sglang(role: str, input_len: int, **decode) -> Callable[[], float]:
    def run() -> float:
        p = predict(sglang_deployment(**decode), Workload(input_len, 100))
        return p.role(role).tok_s_node
    return run


GPU_DECODE = "docs/gpu_decode.md"
SPEC = "docs/spec_mtp.md (plain graph step, 2026-12-06)"
FP8 = "docs/fp8.md"
BLOG = "LMSYS blog 2025-05-05 (SGLang, 96xH100)"

ANCHORS: list[Anchor] = [
    *[Anchor(f"Qwen3-30B-A3B decode step, H200, batch {b}", ref, "ms", 0.10,
             f"{GPU_DECODE} (one_batch, input 512)", _one_gpu_step(
                 "qwen3_30b_a3b", "h200", "bf16", b, 528))
      for b, ref in ((1, 2.75), (64, 18.84), (256, 21.29))],
    *[Anchor(f"Qwen3-30B-A3B decode step, H100, batch {b}", ref, "ms", 0.10, SPEC,
             _one_gpu_step("qwen3_30b_a3b", "h100", "bf16", b, 512))
      for b, ref in ((1, 3.46), (16, 16.08), (64, 25.01))],
    *[Anchor(f"DeepSeek-V3 cut (7 layers) {dt} decode step, H200, batch {b}", ref, "ms", 0.10,
             f"{FP8} (one_batch, input 256)", _one_gpu_step("deepseek_v3", "h200", dt, b, 272, 7))
      for dt, b, ref in (("fp8", 1, 2.05), ("fp8", 64, 11.78), ("bf16", 1, 2.94),
                         ("bf16", 64, 19.09))],
    *[Anchor(f"DeepSeek-V3 cut (5 layers) {dt} decode step, H100, batch {b}", ref, "ms", 0.10,
             f"{FP8} (one_batch, input 256)", _one_gpu_step("deepseek_v3", "h100", dt, b, 272, 5))
      for dt, b, ref in (("fp8", 1, 2.01), ("fp8", 64, 8.94), ("bf16", 1, 2.95),
                         ("bf16", 64, 14.78))],
    Anchor("Qwen3-30B-A3B served, H200, 256 concurrent", 6474.0, "output tok/s", 0.10,
           f"{GPU_DECODE} (bench.serving, input<=256, output<=128, 512 requests)",
           _serving("h200", 256)),
    *[Anchor(f"SGLang prefill, 4 nodes EP32, {n // 1024}K prompts", ref, "input tok/s/node",
             0.15, BLOG, _sglang("prefill", n))
      for n, ref in ((1024, 57674.0), (2048, 54543.0), (4096, 50302.0))],
    Anchor("SGLang decode, 9 nodes EP72, 2K input", 22282.0, "output tok/s/node", 0.15, BLOG,
           _sglang("decode", 2000)),
]

# Published figures outside the targets: printed by --check, not held by tests.
EXTRA: list[Anchor] = [
    Anchor("SGLang decode without TBO (blog: TBO +25.5% at 256 -> 22,310)", 22310 / 1.255,
           "output tok/s/node", 0.15, BLOG, _sglang("decode", 2000, tbo=False)),
]


# Our other measured figures, outside the list: printed by --check and tested, the
# misses as strict xfails with their reasons.
OTHER: list[Anchor] = [
    *[Anchor(f"DeepSeek-V2-Lite decode step, H200, batch {b}", ref, "ms", 0.10,
             f"{GPU_DECODE} (one_batch, input 512)",
             _one_gpu_step("deepseek_v2_lite", "h200", "bf16", b, 528))
      for b, ref in ((1, 2.43), (64, 10.72), (256, 14.81))],
    *[Anchor(f"Llama-3-8B decode step, H100, batch {b}", ref, "ms", 0.10, SPEC,
             _one_gpu_step("llama3_8b", "h100", "bf16", b, 512),
             "the step at 16 rows is 0.8-1.1 ms longer than its priced GEMMs, attention and LM "
             "head (7.15-7.48 ms in three calls); not found yet" if b == 16 else None)
      for b, ref in ((1, 6.08), (16, 7.15), (64, 8.40))],
]


def check(anchors: list[Anchor]) -> list[tuple[Anchor, float, float]]:
    """(anchor, predicted, relative error) for each."""
    out = []
    for a in anchors:
        got = a.predict()
        out.append((a, got, got / a.reference - 1))
    return out


def format_check(rows: list[tuple[Anchor, float, float]]) -> str:
    lines = [f"| {'figure':<58} | {'measured':>10} | {'predicted':>10} | {'error':>7} | "
             f"{'target':>6} | source |", "|" + "---|" * 6]
    for a, got, err in rows:
        ok = "" if abs(err) <= a.target else " MISS"
        lines.append(f"| {a.name:<58} | {a.reference:>10,.2f} | {got:>10,.2f} | "
                     f"{err:>+6.1%} | {a.target:>5.0%}{ok} | {a.source} |")
    return "\n".join(lines)


def profile_gpu(name: str) -> str:
    return load_profile(name).gpu
