"""The small-M GEMV (kernels/triton/gemv.py) against float64 torch, and `Linear` with TritonOps
attached against F.linear; its weight-only FP8 variant against float64 on the dequantized weights (x
not quantized), partial 128 blocks included. Without CUDA: Triton's interpreter in float32 (its
launch geometry, and in some tests the CUDA one); on CUDA also bf16 at Qwen3-30B-A3B's and
DeepSeek-V3's shapes and under graph capture."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from moeserve.kernels.attach import attach_ops  # noqa: E402
from moeserve.kernels.fp8_format import (  # noqa: E402
    dequantize_fp8_blocks, quantize_fp8_blocks)
from moeserve.kernels.triton.gemv import (  # noqa: E402
    FP8_TILE_ELEMS, FP8_WIDE_MIN_ELEMS, GEMV_MAX_M, LINEAR_MAX_M, MIN_BLOCK_K, GemvConfig, gemv,
    gemv_config, gemv_fp8, gemv_fp8_config)
from moeserve.kernels.triton.ops import TritonOps  # noqa: E402
from moeserve.layers.fp8_linear import Fp8Linear  # noqa: E402
from moeserve.layers.linear import Linear, MergedLinear  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
OPS = TritonOps()


def rand(*shape, seed: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(DEVICE, dtype)


def oracle(x, w, b=None) -> torch.Tensor:
    return F.linear(x.double(), w.double(), None if b is None else b.double())


@pytest.mark.parametrize("m", range(1, GEMV_MAX_M + 1))
@pytest.mark.parametrize("n,k,bias", [(70, 130, True), (33, 257, False), (128, 64, True)])
def test_gemv_matches_float64(m, n, k, bias):
    x, w = rand(m, k, seed=m), rand(n, k, seed=n) / k**0.5
    b = rand(n, seed=k) if bias else None
    out = gemv(x, w, b)
    assert out.shape == (m, n) and out.dtype == x.dtype
    torch.testing.assert_close(out.double(), oracle(x, w, b), rtol=1e-5, atol=1e-5)


def test_rows_do_not_depend_on_m():
    """The launch geometry depends on N and K only: row i is the same bits at every M (a
    speculative verify batch equals the plain decode step's rows)."""
    x, w = rand(GEMV_MAX_M, 300, seed=1), rand(40, 300, seed=2)
    full = gemv(x, w)
    for m in (1, 3, GEMV_MAX_M):
        assert torch.equal(gemv(x[:m], w), full[:m])


def test_cuda_launch_geometry_in_interpreter():
    """The CUDA config (one row per program, K steps of 128+; K = 300 leaves a partial step)."""
    x, w, b = rand(3, 300, seed=3), rand(20, 300, seed=4), rand(20, seed=5)
    cfg = gemv_config(20, 300, torch.device("cuda"))
    assert cfg.block_n == 1 and cfg.block_k >= MIN_BLOCK_K and 300 % cfg.block_k
    torch.testing.assert_close(gemv(x, w, b, cfg).double(), oracle(x, w, b), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("n,k", [(5120, 2048), (2048, 4096), (128, 2048), (151936, 2048)])
def test_cuda_geometry(n, k):
    """Qwen3-30B-A3B's linears: >= 512 programs where N allows (the router's 128 rows: one each,
    each row read in one step), 16-byte loads (K steps >= 128), ~8 KB per program per step."""
    cfg = gemv_config(n, k, torch.device("cuda"))
    assert -(-n // cfg.block_n) >= min(512, n) and cfg.block_k >= MIN_BLOCK_K
    assert cfg.block_n * cfg.block_k <= 4096 or cfg.block_n == 1


def test_gemv_strided_rows_and_errors():
    x = rand(4, 100, seed=6)[:, :64]  # row stride 100
    w = rand(24, 64, seed=7)
    torch.testing.assert_close(gemv(x, w).double(), oracle(x, w), rtol=1e-5, atol=1e-5)
    assert gemv(x[:0], w).shape == (0, 24)
    with pytest.raises(ValueError):
        gemv(rand(GEMV_MAX_M + 1, 64, seed=8), w)


def _fp8_weight(n: int, k: int, seed: int, block=(128, 128)):
    """(w e4m3 [N, K], scale [ceil(N/bn), ceil(K/bk)], the dequantized weight in float64)."""
    w_q, w_s = quantize_fp8_blocks(rand(n, k, seed=seed) / k**0.5, block)
    return w_q, w_s, dequantize_fp8_blocks(w_q, w_s, block).double()


@pytest.mark.parametrize("m", range(1, 5))
@pytest.mark.parametrize("n,k,bias,block", [
    (200, 300, True, (128, 128)),  # partial blocks along N and K
    (130, 64, False, (128, 128)),  # K within one block, two scale rows
    (256, 512, True, (128, 128)),  # whole blocks, several K steps' scales
    (72, 200, True, (16, 32)),  # small blocks: block_n clamped to bn = 16
])
def test_gemv_fp8_matches_float64_on_dequantized_weights(m, n, k, bias, block):
    w_q, w_s, w = _fp8_weight(n, k, seed=n + k, block=block)
    x, b = rand(m, k, seed=m), rand(n, seed=k) if bias else None
    out = gemv_fp8(x, w_q, w_s, b, block)
    assert out.shape == (m, n) and out.dtype == x.dtype
    torch.testing.assert_close(out.double(), oracle(x, w, b), rtol=1e-5, atol=1e-5)


def test_gemv_fp8_cuda_launch_geometry_in_interpreter():
    """The CUDA config (one row per program here, a K step of 512 over three scale columns and
    a partial one) and a hand-made one whose steps (64) are shorter than a block (128)."""
    w_q, w_s, w = _fp8_weight(200, 300, seed=1)
    x, b = rand(2, 300, seed=2), rand(200, seed=3)
    cfg = gemv_fp8_config(200, 300, (128, 128), torch.device("cuda"))
    assert cfg.block_n == 1 and cfg.block_k >= MIN_BLOCK_K and 300 % cfg.block_k
    for c in (cfg, GemvConfig(8, 64), GemvConfig(32, 256, 8)):
        torch.testing.assert_close(gemv_fp8(x, w_q, w_s, b, config=c).double(), oracle(x, w, b),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("cfg", [GemvConfig(16, 256), GemvConfig(4, 512), GemvConfig(32, 128, 8),
                                 GemvConfig(8, 1024)])
def test_gemv_fp8_grouped_steps(m, cfg):
    """Whole K steps (K = 1024: 1-8 steps of 1-8 scale groups) and a partial last one (K =
    900), at one row (one sum after the loop) and three (sums per step)."""
    for k in (1024, 900):
        w_q, w_s, w = _fp8_weight(96, k, seed=k)
        x, b = rand(m, k, seed=m + k), rand(96, seed=k + 1)
        torch.testing.assert_close(gemv_fp8(x, w_q, w_s, b, config=cfg).double(),
                                   oracle(x, w, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("k,n", [(7168, 18432), (7168, 576), (2048, 7168), (16384, 7168),
                                 (1536, 24576), (7168, 1536)])
def test_gemv_fp8_cuda_geometry(k, n):
    """DeepSeek-V3's linears: each program's rows inside one 128-row scale block, K steps of
    >= 128 (16-byte e4m3 loads); >= 512 programs where N allows, <= 8 KB a step on 4 warps;
    the large weights (>= 64M elements) 32 rows and 16 KB steps on 8 warps, >= 132 programs."""
    cfg = gemv_fp8_config(n, k, (128, 128), torch.device("cuda"))
    assert 128 % cfg.block_n == 0 and cfg.block_k >= MIN_BLOCK_K
    if n * k >= FP8_WIDE_MIN_ELEMS:
        assert cfg == GemvConfig(32, 512, 8) and -(-n // cfg.block_n) >= 132
        return
    assert -(-n // cfg.block_n) >= min(512, n) and cfg.num_warps == 4
    assert cfg.block_n * cfg.block_k <= FP8_TILE_ELEMS


def test_gemv_fp8_writes_into_a_column_view_and_refuses_bad_inputs():
    w_q, w_s, w = _fp8_weight(40, 200, seed=4)
    x = rand(1, 200, seed=5)
    out = torch.full((1, 100), 7.0, device=DEVICE)
    gemv_fp8(x, w_q, w_s, out=out[:, 30:70])  # [1, 40], row stride 100
    torch.testing.assert_close(out[:, 30:70].double(), oracle(x, w), rtol=1e-5, atol=1e-5)
    assert (out[:, :30] == 7).all() and (out[:, 70:] == 7).all()
    with pytest.raises(ValueError, match="scale"):
        gemv_fp8(x, w_q, w_s[:, :1])  # a scale column short
    with pytest.raises(ValueError, match="scale"):
        gemv_fp8(x, w_q.float(), w_s)  # not e4m3
    with pytest.raises(ValueError, match="divide"):
        gemv_fp8(x, w_q, w_s, block=(128, 128), config=GemvConfig(256, 128))
    with pytest.raises(ValueError):
        gemv_fp8(rand(GEMV_MAX_M + 1, 200, seed=6), w_q, w_s)


def test_ops_linear_applies_only_where_it_can():
    w, b = rand(24, 64, seed=9), rand(24, seed=10)
    x3 = rand(1, LINEAR_MAX_M, 64, seed=11)  # [..., K]
    with torch.no_grad():
        out = OPS.linear(x3, w, b)
        assert out.shape == (1, LINEAR_MAX_M, 24)
        torch.testing.assert_close(out.double(), oracle(x3, w, b), rtol=1e-5, atol=1e-5)
        assert OPS.linear(rand(LINEAR_MAX_M + 1, 64, seed=12), w) is None  # too many rows
        assert OPS.linear(x3.double(), w.double()) is None  # float64
        assert OPS.linear(x3, w.half()) is None  # dtypes differ
        assert OPS.linear(x3, w.t().contiguous().t()) is None  # column-major weight
    w.requires_grad_(True)
    assert OPS.linear(x3, w) is None  # a gradient is wanted: no backward here


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.float16]
                         + ([torch.bfloat16] if DEVICE.type == "cuda" else []))
@pytest.mark.parametrize("e,h", [(64, 96), (256, 7168)])
def test_router_logits_equal_the_float32_gate(x_dtype, e, h, monkeypatch):
    """DeepSeek's gate: x in the activations' dtype, a float32 weight, float32 logits (the
    interpreter's float16 widening is exact, so it stands in for bf16 on CPU); and MoEGate with
    the ops attached runs it at one row and F.linear above."""
    from moeserve.models.deepseek import MoEGate

    x, w = rand(1, h, seed=e, dtype=x_dtype), rand(e, h, seed=h) / h**0.5
    with torch.no_grad():
        logits = OPS.router_logits(x, w)
        assert logits.dtype == torch.float32 and logits.shape == (1, e)
        torch.testing.assert_close(logits, F.linear(x.float(), w), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(logits.double(), oracle(x, w), rtol=1e-5, atol=1e-5)
        assert OPS.router_logits(rand(2, h, seed=1, dtype=x_dtype), w) is None  # > 1 row
        assert OPS.router_logits(x, w.double()) is None  # the gate's weight is float32
        with torch.device(DEVICE):
            gate = MoEGate(h, e, with_bias=True)
        gate.weight.data.copy_(w)
        want = gate(x)
        gate.gpu_ops = OPS
        used = []
        orig = OPS.router_logits
        monkeypatch.setattr(OPS, "router_logits", lambda *a: used.append(orig(*a) is not None)
                            or orig(*a))
        torch.testing.assert_close(gate(x), want, rtol=1e-5, atol=1e-5)
        x2 = rand(3, h, seed=2, dtype=x_dtype)
        torch.testing.assert_close(gate(x2), F.linear(x2.float(), w))
        assert used == [True, False]  # taken at 1 row, declined at 3


def _linear(cls, *args, seed: int, **kwargs):
    with torch.device(DEVICE):
        lin = cls(*args, **kwargs)
    for p in lin.parameters():
        p.data.copy_(rand(*p.shape, seed=seed) / p.shape[-1] ** 0.5)
    return lin


@pytest.mark.parametrize("rows", [1, LINEAR_MAX_M + 1, GEMV_MAX_M + 3])
def test_linear_module_with_ops_equals_f_linear(rows, monkeypatch):
    lin = _linear(Linear, 96, 40, bias=True, seed=13)
    merged = _linear(MergedLinear, 96, [24, 16], ["a", "b"], seed=14)
    x = rand(rows, 96, seed=rows)
    assert OPS.usable(x)  # else the modules fall back to torch, and this test proves nothing
    assert attach_ops(lin, "gpu_ops", OPS) == 1 and attach_ops(merged, "gpu_ops", OPS) == 1
    used = []
    orig = OPS.linear
    monkeypatch.setattr(OPS, "linear", lambda *a: used.append(orig(*a) is not None) or orig(*a))
    with torch.no_grad():
        for m in (lin, merged):
            torch.testing.assert_close(m(x), F.linear(x, m.weight, m.bias), rtol=1e-5, atol=1e-5)
    assert used == [rows <= LINEAR_MAX_M] * 2
    y = lin(x)  # grad mode: F.linear, and backward works
    y.sum().backward()
    assert lin.weight.grad is not None


def test_fp8_linear_takes_only_the_pdl_flag_of_gpu_ops():
    """Fp8Linear is no `Linear`: attach_ops hands it the TritonOps for their `pdl` flag, and its
    FP8 GEMMs keep running (an ops object whose every other attribute raises is never used)."""

    class FlagOnly:
        pdl = True

        def __getattr__(self, name):
            raise AssertionError(f"Fp8Linear used gpu_ops.{name}")

    assert not issubclass(Fp8Linear, Linear)
    model = torch.nn.Sequential(Fp8Linear(256, 128, backend="torch"))
    assert attach_ops(model, "gpu_ops", FlagOnly()) == 1
    lin = model[0]
    lin.weight.data.copy_((torch.randn(128, 256) * 0.1).to(lin.weight.dtype))
    x = torch.randn(3, 256)
    torch.testing.assert_close(lin(x), F.linear(x, lin.dequantized()))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4, GEMV_MAX_M])
@pytest.mark.parametrize("k,n", [(2048, 5120), (4096, 2048), (2048, 128), (2048, 151936),
                                 (7168, 576), (1000, 300)])
def test_gpu_bf16_matches_f_linear(m, k, n):
    x, w = rand(m, k, seed=m, dtype=torch.bfloat16), rand(n, k, seed=n) / k**0.5
    w, b = w.to(torch.bfloat16), rand(n, seed=k, dtype=torch.bfloat16)
    out = gemv(x, w, b)
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.double(), oracle(x, w, b), rtol=1e-2, atol=1e-2)
    assert torch.equal(gemv(x[:1], w, b), out[:1])


@pytest.mark.gpu
def test_gpu_graph_replay():
    x, w = rand(4, 2048, seed=1, dtype=torch.bfloat16), rand(512, 2048, seed=2,
                                                            dtype=torch.bfloat16)
    gemv(x, w)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemv(x, w)
    x.copy_(rand(4, 2048, seed=3, dtype=torch.bfloat16))
    graph.replay()
    torch.testing.assert_close(out.double(), oracle(x, w), rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4])
@pytest.mark.parametrize("k,n", [(7168, 18432), (7168, 576), (2048, 7168), (16384, 7168),
                                 (1000, 300)])
def test_gpu_fp8_bf16_activations_match_float64(m, k, n):
    """bf16 x (not quantized) on e4m3 weights, DeepSeek-V3's shapes: float64 on the dequantized
    weights; row 0 at M = 1 (one sum after the loop) close to M = 4's (sums per step); a CUDA
    graph replays it."""
    w_q, w_s, w = _fp8_weight(n, k, seed=n)
    x, b = rand(m, k, seed=m, dtype=torch.bfloat16), rand(n, seed=k, dtype=torch.bfloat16)
    out = gemv_fp8(x, w_q, w_s, b)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), oracle(x, w, b), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(gemv_fp8(x[:1], w_q, w_s, b), out[:1], rtol=1e-2, atol=1e-2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = gemv_fp8(x, w_q, w_s, b)
    x.copy_(rand(m, k, seed=m + 1, dtype=torch.bfloat16))
    graph.replay()
    torch.testing.assert_close(replayed.double(), oracle(x, w, b), rtol=1e-2, atol=1e-2)
