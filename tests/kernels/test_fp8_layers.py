"""FP8-resident layers (layers/fp8_linear.py, layers/fp8_moe.py) on their Triton path (Triton's
interpreter on CPU) against float64 references on the dequantized weights and the quantized
activations (at one row, and at <= SMALL_MAX_PAIRS expert pairs, the weight-only GEMVs: the
activations as they are); their torch reference path against float64 on the dequantized weights.
Dims are not multiples of 128; the experts are an EP-local slice of the global ids. The FP8
linear's GEMM choice by M (W8A16 GEMV / fused Triton / torch._scaled_mm / Triton) with the
scaled_mm probe forced either way (a torch stand-in for torch._scaled_mm on CPU); on CUDA the
real one, and CUDA graph replay."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moeserve.kernels.triton import fp8 as kernels
from moeserve.kernels.triton import fused_moe as fm
from moeserve.kernels.triton import gemv as gemv_kernels
from moeserve.kernels.triton.fp8 import quant_fp8_per_token_group
from moeserve.kernels.fp8_format import FP8, dequantize_fp8_blocks, quantize_fp8_blocks
from moeserve.layers import fp8_linear as lin
from moeserve.kernels.triton.fused_moe_small import SMALL_MAX_PAIRS
from moeserve.layers.fp8_linear import (W8A16_MAX_M, Fp8Linear, Fp8MergedLinear, ScaledMMLayout,
                                        fp8_gemm_path)
from moeserve.layers.fp8_moe import Fp8MoEExperts

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.float32 if DEVICE == "cpu" else torch.bfloat16
TOL = 1e-5 if DTYPE == torch.float32 else 2e-2  # fp32: accumulation order only


def _quantized_rows(x: torch.Tensor) -> torch.Tensor:
    """x [T, K] as the Triton path sees it: per-token groups of 128 in e4m3 → float64."""
    x_q, x_s = quant_fp8_per_token_group(x)
    return x_q.double() * x_s.double().repeat_interleave(128, 1)[:, : x.shape[1]]


def _activations(x: torch.Tensor) -> torch.Tensor:
    """x [T, K] as fp8_linear's kernel reads it on these tests' small weights: unquantized at
    W8A16_MAX_M rows (the GEMV), else quantized."""
    return x.double().cpu() if x.shape[0] <= W8A16_MAX_M else _quantized_rows(x).cpu()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double().cpu() - b.double().cpu()).norm() / b.double().cpu().norm())


def _fill(layer: Fp8Linear, w: torch.Tensor) -> None:
    q, s = quantize_fp8_blocks(w)
    layer.weight.data.copy_(q)
    layer.weight_scale_inv.data.copy_(s)


@pytest.mark.parametrize("t", [1, 7, 70])
def test_fp8_linear_triton_equals_float64_reference(t):
    g = torch.Generator().manual_seed(t)
    layer = Fp8Linear(300, 200, bias=True, backend="triton", bias_dtype=DTYPE, device=DEVICE)
    _fill(layer, (torch.randn(200, 300, generator=g) * 0.05).to(DEVICE))
    layer.bias.data.copy_(torch.randn(200, generator=g))
    assert layer.weight.dtype == FP8 and layer.weight_scale_inv.shape == (2, 3)
    x = torch.randn(t, 300, generator=g).to(DEVICE, DTYPE)
    out = layer(x[None])[0]  # leading dims are kept
    w = layer.dequantized().double()
    ref = _activations(x) @ w.cpu().T + layer.bias.double().cpu()
    assert out.shape == (t, 200) and out.dtype == DTYPE and _rel(out, ref) < TOL
    layer.backend = "torch"  # reference: dequantized weight, activations as they are
    assert _rel(layer(x), x.double().cpu() @ w.cpu().T + layer.bias.double().cpu()) < TOL


@pytest.mark.parametrize("sizes,aligned", [([72, 100], False), ([128, 72], True),
                                           ([200, 56, 56], False)])
def test_fp8_merged_linear_shards_blocked_apart(sizes, aligned):
    """Each shard is quantized on its own (as checkpoints store gate/up or q/k/v); unaligned
    shard starts run one GEMM per shard."""
    names = [f"s{j}" for j in range(len(sizes))]
    g = torch.Generator().manual_seed(len(sizes))
    layer = Fp8MergedLinear(200, sizes, names, backend="triton", device=DEVICE)
    assert layer.aligned == aligned
    parts = [(torch.randn(n, 200, generator=g) * 0.05).to(DEVICE) for n in sizes]
    for name, w in zip(reversed(names), reversed(parts)):  # any load order
        q, s = quantize_fp8_blocks(w)
        layer.weight_loader(layer.weight, q, name)
        layer.weight_loader(layer.weight_scale_inv, s, name)
    deq = torch.cat([dequantize_fp8_blocks(*quantize_fp8_blocks(w)) for w in parts]).double()
    assert torch.equal(layer.dequantized().double(), deq)
    x = torch.randn(9, 200, generator=g).to(DEVICE, DTYPE)
    assert _rel(layer(x), _quantized_rows(x).cpu() @ deq.cpu().T) < TOL
    layer.backend = "torch"
    assert _rel(layer(x), x.double().cpu() @ deq.cpu().T) < TOL
    with pytest.raises(ValueError, match="shard 's0'"):
        layer.weight_loader(layer.weight_scale_inv, torch.ones(5, 2), "s0")


def _fake_scaled_mm(calls: list, refuse=lambda a, scale_a, scale_b: False, wrong=False):
    """A torch stand-in for torch._scaled_mm with 1x128 / 128x128 block scales (float64), which
    records its inputs' shapes and strides and refuses (RuntimeError) where `refuse` says."""

    def scaled_mm(a, b, scale_a, scale_b, out_dtype=None, **_):
        calls.append((tuple(a.shape), scale_a.stride(), tuple(scale_b.shape), scale_b.stride()))
        if refuse(a, scale_a, scale_b):
            raise RuntimeError("refused by the stand-in")
        assert a.dtype == b.dtype == FP8 and b.stride(0) == 1  # b = w.t(): column-major
        k, n = b.shape
        a64 = a.double() * scale_a.double().repeat_interleave(128, 1)[:, :k]
        b64 = b.double() * scale_b.double().repeat_interleave(128, 0).repeat_interleave(128, 1)[
            :k, :n]
        return (torch.zeros_like(a64 @ b64) if wrong else a64 @ b64).to(out_dtype)

    return scaled_mm


def _record_calls(monkeypatch, module, names: tuple[str, ...]) -> list[str]:
    """The names of `module`'s functions among `names` as they get called (they still run)."""
    calls: list[str] = []
    for name in names:
        def spy(*args, _real=getattr(module, name), _name=name, **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, spy)
    return calls


def test_gemm_path_by_static_m(monkeypatch):
    """Decode sizes take the fused kernel; from SCALED_MM_MIN_M torch._scaled_mm where the probe
    accepted it and the shape suits it (128 x 128 blocks, K % 512, N % 16, the probed dtype)."""
    layout = ScaledMMLayout(True, False, dtype=torch.bfloat16)
    monkeypatch.setattr(lin, "scaled_mm_layout", lambda device: layout)
    bf16, cuda = torch.bfloat16, torch.device("cuda", 0)
    assert [fp8_gemm_path(m, 576, 7168, (128, 128), bf16, cuda)
            for m in (1, 2, 16, 17, 4096)] == ["gemv", "fused", "fused", "scaled_mm", "scaled_mm"]
    assert fp8_gemm_path(1, 576, 7168, (128, 128), torch.float64, cuda) == "fused"
    # batch 1 on DeepSeek-V3's large weights (dense gate_up, o_proj): the fused kernel streams
    # them faster than the GEMV; the shared expert's gate_up (7168 -> 4096) stays on the GEMV
    assert [fp8_gemm_path(1, n, k, (128, 128), bf16, cuda)
            for k, n in [(7168, 36864), (16384, 7168), (7168, 4096)]] == ["fused", "fused", "gemv"]
    for n, k, block, dtype in [(576, 300, (128, 128), bf16),  # K not a multiple of 512
                               (200, 7168, (128, 128), bf16),  # N not a multiple of 16
                               (576, 7168, (64, 64), bf16),  # other blocks
                               (576, 7168, (128, 128), torch.float32)]:  # not the probed dtype
        assert fp8_gemm_path(64, n, k, block, dtype, cuda) == "triton"
    monkeypatch.setattr(lin, "scaled_mm_layout", lambda device: None)  # the probe failed
    assert fp8_gemm_path(64, 576, 7168, (128, 128), bf16, cuda) == "triton"


def test_fp8_linear_dispatch_with_the_probe_forced_both_ways(monkeypatch):
    """Probe accepted (M padded to 4, column-major activation scales written by the quant
    kernel): M = 37 runs torch._scaled_mm once, M = 8 the fused kernel; a biased layer at M = 37
    the Triton GEMM (its epilogue adds the bias before the one rounding; after _scaled_mm's bf16
    output it would round twice); probe failed: Triton. Every path equals float64 on the
    dequantized weights and the quantized activations."""
    g = torch.Generator().manual_seed(4)
    layer = Fp8Linear(512, 320, backend="triton", device=DEVICE)
    _fill(layer, (torch.randn(320, 512, generator=g) * 0.05).to(DEVICE))
    w = layer.dequantized().double().cpu()
    calls: list = []
    ran = _record_calls(monkeypatch, kernels, ("fp8_quant_matmul", "fp8_block_matmul"))
    monkeypatch.setattr(torch, "_scaled_mm", _fake_scaled_mm(calls))
    monkeypatch.setattr(lin, "scaled_mm_layout",
                        lambda device: ScaledMMLayout(True, False, row_multiple=4, dtype=DTYPE))
    for m, n_calls, triton_calls in [(37, 1, []), (8, 1, ["fp8_quant_matmul"])]:
        x = torch.randn(m, 512, generator=g).to(DEVICE, DTYPE)
        out = layer(x)
        assert out.shape == (m, 320) and len(calls) == n_calls and ran == triton_calls
        assert _rel(out, _quantized_rows(x).cpu() @ w.T) < TOL
    assert calls[0][:2] == ((40, 512), (1, 40)) and calls[0][2:] == ((4, 3), (1, 4))
    biased = Fp8Linear(512, 320, bias=True, backend="triton", bias_dtype=DTYPE, device=DEVICE)
    biased.load_state_dict(layer.state_dict(), strict=False)
    biased.bias.data.copy_(torch.randn(320, generator=g))
    bias = biased.bias.double().cpu()
    x = torch.randn(37, 512, generator=g).to(DEVICE, DTYPE)
    assert _rel(biased(x), _quantized_rows(x).cpu() @ w.T + bias) < TOL
    assert len(calls) == 1 and ran[-1] == "fp8_block_matmul"
    monkeypatch.setattr(lin, "scaled_mm_layout", lambda device: None)  # the probe failed
    x = torch.randn(37, 512, generator=g).to(DEVICE, DTYPE)
    assert _rel(layer(x), _quantized_rows(x).cpu() @ w.T) < TOL
    assert len(calls) == 1 and ran[-2:] == ["fp8_block_matmul", "fp8_block_matmul"]


@pytest.mark.parametrize("lead", [(1,), (1, 1)])
def test_fp8_linear_at_one_row_runs_the_w8a16_gemv(lead, monkeypatch):
    """M = 1 (leading dims kept): one gemv_fp8 launch, no activation quantization, float64 on
    the dequantized weight and x as it is, bias added; M = 2 is back on the fused kernel."""
    g = torch.Generator().manual_seed(11)
    layer = Fp8Linear(300, 200, bias=True, backend="triton", bias_dtype=DTYPE, device=DEVICE)
    _fill(layer, (torch.randn(200, 300, generator=g) * 0.05).to(DEVICE))
    layer.bias.data.copy_(torch.randn(200, generator=g))
    w, bias = layer.dequantized().double().cpu(), layer.bias.double().cpu()
    gemv = _record_calls(monkeypatch, gemv_kernels, ("gemv_fp8",))
    fp8 = _record_calls(monkeypatch, kernels, ("fp8_quant_matmul", "quant_fp8_per_token_group"))
    x = torch.randn(*lead, 300, generator=g).to(DEVICE, DTYPE)
    out = layer(x)
    assert out.shape == (*lead, 200) and out.dtype == DTYPE
    assert gemv == ["gemv_fp8"] and fp8 == []
    assert _rel(out.reshape(1, 200), x.reshape(1, 300).double().cpu() @ w.T + bias) < TOL
    layer(torch.randn(2, 300, generator=g).to(DEVICE, DTYPE))
    assert gemv == ["gemv_fp8"] and fp8 == ["fp8_quant_matmul"]


@pytest.mark.parametrize("sizes", [[72, 100], [128, 72]])
def test_fp8_merged_linear_at_one_row_runs_a_gemv_per_shard(sizes, monkeypatch):
    """Unaligned shards: one gemv_fp8 into each shard's columns (with its bias slice); aligned:
    one over the whole weight."""
    names = [f"s{j}" for j in range(len(sizes))]
    g = torch.Generator().manual_seed(sum(sizes))
    layer = Fp8MergedLinear(200, sizes, names, bias=True, backend="triton", bias_dtype=DTYPE,
                            device=DEVICE)
    for name, n in zip(names, sizes):
        q, s = quantize_fp8_blocks((torch.randn(n, 200, generator=g) * 0.05).to(DEVICE))
        layer.weight_loader(layer.weight, q, name)
        layer.weight_loader(layer.weight_scale_inv, s, name)
        layer.weight_loader(layer.bias, torch.randn(n, generator=g).to(DEVICE, DTYPE), name)
    ran = _record_calls(monkeypatch, gemv_kernels, ("gemv_fp8",))
    x = torch.randn(1, 200, generator=g).to(DEVICE, DTYPE)
    ref = x.double().cpu() @ layer.dequantized().double().cpu().T + layer.bias.double().cpu()
    assert _rel(layer(x), ref) < TOL
    assert ran == ["gemv_fp8"] * (1 if layer.aligned else len(sizes))


def test_probe_takes_the_first_layout_that_runs_and_matches(monkeypatch):
    """Refusals and wrong results rule layouts out; M is padded when only multiples of 4 run."""
    def refuse(a, scale_a, scale_b):
        return a.shape[0] % 4 != 0 or not scale_b.is_contiguous()

    calls: list = []
    monkeypatch.setattr(torch, "_scaled_mm", _fake_scaled_mm(calls, refuse=refuse))
    layout, why = lin.probe_scaled_mm(torch.device(DEVICE), DTYPE)
    assert layout == ScaledMMLayout(True, True, row_multiple=4, dtype=DTYPE) and why == ""
    monkeypatch.setattr(torch, "_scaled_mm", _fake_scaled_mm(calls, wrong=True))
    layout, why = lin.probe_scaled_mm(torch.device(DEVICE), DTYPE)
    assert layout is None and "relative error" in why


def test_scaled_mm_layout_probes_once_per_device_and_not_while_capturing(monkeypatch, caplog):
    probes = []
    found = ScaledMMLayout(True, False)
    monkeypatch.setattr(lin, "_probed", {})
    monkeypatch.setattr(lin, "probe_scaled_mm", lambda device: probes.append(device) or (found, ""))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert lin.scaled_mm_layout(torch.device("cuda", 0)) is None and not probes  # graph capture
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    with caplog.at_level("INFO", logger=lin.__name__):
        assert lin.scaled_mm_layout(torch.device("cuda", 0)) == found
        assert lin.scaled_mm_layout(torch.device("cuda", 0)) == found
    assert probes == [torch.device("cuda", 0)]
    assert [r.getMessage() for r in caplog.records if "torch._scaled_mm for M >= 17" in
            r.getMessage()] != []
    assert lin.scaled_mm_layout(torch.device("cpu")) is None


@pytest.mark.gpu
def test_scaled_mm_on_cuda_equals_float64_and_is_chosen_above_the_threshold():
    """This torch/GPU (H200) takes DeepSeek's scales in torch._scaled_mm (the bench measured it):
    the probe finds a layout, and it matches float64 on DeepSeek-V3's small-N shapes, ragged M."""
    layout = lin.scaled_mm_layout(torch.device("cuda"))
    assert layout is not None, "torch._scaled_mm refused 1x128 / 128x128 scales here"
    g = torch.Generator().manual_seed(9)
    for m, k, n in [(17, 7168, 576), (37, 1536, 1024), (64, 7168, 1536), (256, 16384, 512)]:
        w_q, w_s = quantize_fp8_blocks((torch.randn(n, k, generator=g) * 0.02).cuda())
        x = torch.randn(m, k, generator=g).cuda().to(torch.bfloat16)
        out = lin.scaled_mm_linear(x, w_q, w_s, layout)
        ref = _quantized_rows(x).cpu() @ dequantize_fp8_blocks(w_q, w_s).double().cpu().T
        print(f"\n[fp8 scaled_mm] {layout} M {m} {k} -> {n}: rel err {_rel(out, ref):.2e}")
        assert out.shape == (m, n) and _rel(out, ref) < 1e-2
        assert fp8_gemm_path(m, n, k, (128, 128), torch.bfloat16, x.device) == "scaled_mm"


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 64])
def test_fp8_linear_cuda_graph_replay_equals_eager(m):
    """Each path (fused with split-K at M <= 16, scaled_mm or Triton above) replays in a CUDA
    graph exactly as it runs eagerly, on new inputs (split-K counters reset every launch)."""
    g = torch.Generator().manual_seed(m)
    layer = Fp8Linear(7168, 576, device="cuda")
    _fill(layer, (torch.randn(576, 7168, generator=g) * 0.02).cuda())
    static = torch.randn(m, 7168, generator=g).cuda().to(torch.bfloat16)
    layer(static)  # warm-up outside capture: compiles, probes
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(static)
    for _ in range(3):
        static.copy_(torch.randn(m, 7168, generator=g).to(torch.bfloat16))
        graph.replay()
        assert torch.equal(out, layer(static))
    ref = _activations(static) @ layer.dequantized().double().cpu().T
    assert _rel(out, ref) < 1e-2


def _experts(first: int, num_local: int, num_experts: int, h: int, i: int, seed: int):
    """Fp8MoEExperts loaded per checkpoint tensor (each quantized on its own) and the float64
    dequantized (w13 [E, 2I, H], w2 [E, H, I]) of its local slots."""
    m = Fp8MoEExperts(num_experts, h, i, first_expert=first, num_local=num_local,
                      backend="triton")
    m.to(DEVICE)
    g = torch.Generator().manual_seed(seed)
    deq13, deq2 = [], []
    for e in range(first, first + num_local):
        gate, up = (torch.randn(i, h, generator=g) / h**0.5 for _ in range(2))
        down = torch.randn(h, i, generator=g) / i**0.5
        tiles = []
        for shard, w, param in (("gate", gate, m.w13), ("up", up, m.w13), ("down", down, m.w2)):
            q, s = quantize_fp8_blocks(w.to(DEVICE))
            m.weight_loader(param, q, e, shard)
            m.weight_loader(m.w13_scale_inv if param is m.w13 else m.w2_scale_inv, s, e, shard)
            tiles.append(dequantize_fp8_blocks(q, s).double().cpu())
        deq13.append(torch.cat(tiles[:2]))
        deq2.append(tiles[2])
    return m, torch.stack(deq13), torch.stack(deq2)


def _moe_reference(x, ids, weights, w13, w2, first, quantize: bool) -> torch.Tensor:
    """float64 sum over local pairs; `quantize`: the activations (x, then the intermediate) as
    the FP8 kernels quantize them."""
    t, i = x.shape[0], w13.shape[1] // 2
    xd = _quantized_rows(x).cpu() if quantize else x.double().cpu()
    out = torch.zeros(t, x.shape[1], dtype=torch.float64)
    for tok in range(t):
        for j in range(ids.shape[1]):
            e = int(ids[tok, j]) - first
            if not 0 <= e < w13.shape[0]:
                continue
            gu = w13[e] @ xd[tok]
            inter = F.silu(gu[:i]) * gu[i:]
            if quantize:
                inter = _quantized_rows(inter[None].to(DEVICE, DTYPE))[0].cpu()
            out[tok] += float(weights[tok, j]) * (w2[e] @ inter)
    return out


@pytest.mark.parametrize("t,first,num_local", [(1, 0, 10), (12, 3, 4), (33, 6, 4)])
def test_fp8_experts_triton_and_reference_equal_float64(t, first, num_local):
    """H 200 and I 72 (partial blocks), 10 global experts of which [first, first + num_local)
    are local: the other ids contribute nothing. T = 1 (3 pairs) runs the weight-only GEMVs
    (activations not quantized), more pairs the sorted path."""
    h, i, e_global, k = 200, 72, 10, 3
    m, w13, w2 = _experts(first, num_local, e_global, h, i, seed=t)
    assert m.w13.dtype == FP8 and m.w13_scale_inv.shape == (num_local, 2, 2)
    g = torch.Generator().manual_seed(100 + t)
    x = torch.randn(t, h, generator=g).to(DEVICE, DTYPE)
    ids = torch.rand(t, e_global, generator=g).argsort(1)[:, :k].to(DEVICE)
    weights = torch.rand(t, k, generator=g).to(DEVICE)
    out = m(x, ids, weights)
    ref = _moe_reference(x, ids.cpu(), weights.cpu(), w13, w2, first,
                         quantize=t * k > SMALL_MAX_PAIRS)
    assert out.shape == (t, h) and out.dtype == DTYPE
    assert _rel(out, ref) < (1e-4 if DTYPE == torch.float32 else 5e-2)  # intermediate rounding
    m.backend = "torch"
    ref = _moe_reference(x, ids.cpu(), weights.cpu(), w13, w2, first, quantize=False)
    assert _rel(m(x, ids, weights), ref) < TOL
    for masked in (False, True):  # host-syncing (CPU) and graph-safe (CUDA) references
        assert _rel(m.forward_reference(x, ids, weights, masked), ref) < TOL
    s13, s2 = m.stacked_weights(torch.float64)  # the low-latency dispatch format's weights
    assert torch.equal(s13.cpu(), w13) and torch.equal(s2.cpu(), w2)


def test_fp8_experts_fill_redundant_replicas_and_check_shapes():
    m = Fp8MoEExperts(6, 64, 40, first_expert=0, num_local=3, slot_logical=[4, 1, 4])
    q, s = quantize_fp8_blocks(torch.randn(40, 64))
    m.weight_loader(m.w13, q, 4, "up")
    m.weight_loader(m.w13_scale_inv, s, 4, "up")
    assert torch.equal(m.w13[0, 40:].view(torch.uint8), m.w13[2, 40:].view(torch.uint8))
    assert torch.equal(m.w13_scale_inv[0, 1:], s) and torch.equal(m.w13_scale_inv[2, 1:], s)
    with pytest.raises(ValueError, match="expert 1 down scales"):
        m.weight_loader(m.w2_scale_inv, torch.ones(2, 2), 1, "down")


@pytest.mark.parametrize("rows", [5, 12])
def test_fp8_experts_low_latency_layout_through_the_fused_kernel(rows):
    """[E_local, M, H] (DeepEP low-latency format): each row through its block's expert,
    unweighted; the Triton path against float64, activations quantized on the sorted path
    (3 x 12 = 36 pairs) and not on the GEMV one (15)."""
    m, w13, w2 = _experts(4, 3, 8, 200, 72, seed=5)
    x = torch.randn(3, rows, 200, generator=torch.Generator().manual_seed(6)).to(DEVICE, DTYPE)
    out = m.forward_per_expert(x)
    assert out.shape == (3, rows, 200) and out.dtype == DTYPE
    n = 3 * rows
    ids = torch.arange(4, 7).repeat_interleave(rows)[:, None]
    ref = _moe_reference(x.reshape(n, 200), ids, torch.ones(n, 1), w13, w2, 4,
                         quantize=n > SMALL_MAX_PAIRS)
    assert _rel(out.reshape(n, 200), ref) < (1e-4 if DTYPE == torch.float32 else 5e-2)
    m.backend = "torch"
    ref = _moe_reference(x.reshape(n, 200), ids, torch.ones(n, 1), w13, w2, 4, quantize=False)
    assert _rel(m.forward_per_expert(x).reshape(n, 200), ref) < TOL


def test_fp8_experts_at_few_pairs_take_the_small_path(monkeypatch):
    """Fp8MoEExperts at <= SMALL_MAX_PAIRS pairs reaches fused_moe_small with its scales."""
    calls = []
    orig = fm.fused_moe_small

    def spy(*args, **kwargs):
        calls.append(kwargs.get("w13_scale") is not None)
        return orig(*args, **kwargs)

    monkeypatch.setattr(fm, "fused_moe_small", spy)
    m, w13, w2 = _experts(2, 4, 8, 200, 72, seed=8)
    g = torch.Generator().manual_seed(9)
    for t in (4, 5):  # 32 pairs, then 40
        x = torch.randn(t, 200, generator=g).to(DEVICE, DTYPE)
        ids = torch.rand(t, 8, generator=g).argsort(1).to(DEVICE)
        weights = torch.rand(t, 8, generator=g).to(DEVICE)
        ref = _moe_reference(x, ids.cpu(), weights.cpu(), w13, w2, 2, quantize=t == 5)
        assert _rel(m(x, ids, weights), ref) < (1e-4 if DTYPE == torch.float32 else 5e-2)
    assert calls == [True]


@pytest.mark.gpu
@pytest.mark.parametrize("k,n,path", [(7168, 18432, "fused"), (7168, 576, "gemv"),
                                      (2048, 7168, "gemv"), (1000, 300, "gemv")])
def test_fp8_linear_at_one_row_on_cuda_equals_float64(k, n, path):
    """bf16 activations at M = 1 (DeepSeek-V3's shapes): float64 on the dequantized weight and
    x as the path reads it (as it is for the W8A16 GEMV, quantized for the fused kernel), bias
    included."""
    g = torch.Generator().manual_seed(k + n)
    layer = Fp8Linear(k, n, bias=True, bias_dtype=torch.bfloat16, device="cuda")
    _fill(layer, (torch.randn(n, k, generator=g) * k**-0.5).cuda())
    layer.bias.data.copy_(torch.randn(n, generator=g))
    x = torch.randn(1, k, generator=g).cuda().to(torch.bfloat16)
    assert fp8_gemm_path(1, n, k, (128, 128), torch.bfloat16, x.device) == path
    xs = x.double().cpu() if path == "gemv" else _quantized_rows(x).cpu()
    ref = xs @ layer.dequantized().double().cpu().T + layer.bias.double().cpu()
    assert _rel(layer(x), ref) < 1e-2
