"""Issue 44's FP8 finding, measured on CUDA: the tiny DeepSeek-V3 FP8 checkpoints (partial
128 x 128 blocks; hidden 64 and 320) served in bf16 on the FP8 kernels, against the float64
emulation of the same arithmetic on the same bf16 model (layers/fp8_emulation.py: same weight
blocks, same per-token-group activation quantization where the kernels quantize). Per prompt
(lengths 1 / 4 / 12 / 40 / 96: the W8A16 GEMV, fused quantization and GEMM paths, small and
sorted fused MoE) the kernels' logits stay closer to the emulation than bf16's own noise (the
dequantized model in bf16 against float32) with the FP8 tiles widened to bf16 before tl.dot
(`EXACT_DOT`: float32 accumulation, as the emulation assumes). With Hopper's FP8 wgmma as served
(its accumulator is not float32 within a 128-wide K group) they do not at M >= 17 (docs/fp8.md),
so for the served kernels the test holds the issue's measures instead: KL and top-1 agreement
against the dequantized bf16 model as good as the emulation's, within bf16's noise.
`model.quantization=auto` (the finding's) holds the same FP8 modules as `fp8`. The table for
more models: bench/fp8_accuracy.py."""

from __future__ import annotations

import pytest
import torch

from moeserve.bench.fp8_accuracy import compare, make_runner, model_path, run_variant
from moeserve.config import compose
from moeserve.kernels.triton import fp8 as fp8_kernels
from moeserve.layers.fp8_moe import set_fp8_backend
from moeserve.runtime.model_runner import ModelRunner

pytestmark = pytest.mark.gpu

LENGTHS = (1, 4, 12, 40, 96)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("name", ["tiny_v3_fp8", "tiny_v3_wide_fp8"])
def test_fp8_kernels_within_bf16_noise_of_the_float64_emulation(name, tmp_path, monkeypatch):
    path = model_path(name, str(tmp_path))
    lp, f32 = make_runner(path, "cuda", "bfloat16"), make_runner(path, "cpu", "float32")
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 30000, (n,), generator=g).tolist() for n in LENGTHS]
    v = {b: run_variant(lp, b, prompts, 0) for b in ("triton", "emulate", "torch")}
    with monkeypatch.context() as mp:
        mp.setattr(fp8_kernels, "EXACT_DOT", True)
        exact = run_variant(lp, "triton", prompts, 0)
    v32 = {b: run_variant(f32, b, prompts, 0) for b in ("torch", "emulate")}
    for i, p in enumerate(prompts):
        gap = _rel(exact.logits[i], v["emulate"].logits[i])
        served = _rel(v["triton"].logits[i], v["emulate"].logits[i])
        noise = _rel(v["torch"].logits[i], v32["torch"].logits[i])
        emu_noise = _rel(v["emulate"].logits[i], v32["emulate"].logits[i])
        fp8 = _rel(v32["emulate"].logits[i], v32["torch"].logits[i])
        print(f"\n[fp8 acc] {name} len {len(p)}: kernels vs emulation (bf16) {gap:.2e} exact "
              f"dot, {served:.2e} served; bf16 noise: dequantized {noise:.2e}, emulation "
              f"{emu_noise:.2e}; fp32 emulation vs dequantized {fp8:.2e}")
        assert gap < noise
    kernels = compare(name, "kernels", "bf16 dequantized", v["triton"], v["torch"])
    emulated = compare(name, "emulation", "bf16 dequantized", v["emulate"], v["torch"])
    noise = compare(name, "bf16", "fp32", v["torch"], v32["torch"])
    print(f"[fp8 acc] {name}: KL / top-1 vs bf16 dequantized: kernels {kernels.kl:.3e} / "
          f"{kernels.top1:.3f}, emulation {emulated.kl:.3e} / {emulated.top1:.3f}; bf16 vs "
          f"fp32 dequantized {noise.kl:.3e} / {noise.top1:.3f}")
    assert kernels.kl <= emulated.kl + noise.kl
    assert kernels.top1 >= emulated.top1 - (1 - noise.top1)
    # the finding's setting (auto) holds the same FP8 modules and computes the same logits
    auto = ModelRunner(compose(["device=cuda", "model.dtype=bfloat16", "model.quantization=auto",
                                "cuda_graph.enabled=false"]), path)
    assert set_fp8_backend(auto.model, "triton") == set_fp8_backend(lp.model, "triton")
    same = run_variant(auto, "triton", prompts[2:3], 0).logits[0]
    assert _rel(same, v["triton"].logits[2]) < 1e-4
