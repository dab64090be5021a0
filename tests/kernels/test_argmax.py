"""The one-launch argmax (kernels/triton/argmax.py) against torch.argmax: ties (the first index),
NaN (the first NaN's index), -inf rows, partial last chunks, float32 / bf16 / fp16 logits, several
rows, and the counters zero again between launches. Without CUDA: Triton's interpreter with small
chunks; on CUDA also DeepSeek-V3's and Qwen3's vocabularies, and CUDA graph replay."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from moeserve.kernels.triton.argmax import MAX_ROWS, _counters, argmax_rows  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BLOCK = 4096 if DEVICE.type == "cuda" else 64  # the interpreter runs programs one by one


def _rows(b: int, v: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """Random rows with planted ties of the maximum (across chunks and inside one), a NaN row,
    a row with +inf, and an all -inf row, where b allows."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, v, generator=g).to(dtype)
    top = x.float().max() + 1
    x[0, [v // 3, 5, v - 1]] = top.to(dtype)  # first index wins: 5
    if b > 1:
        x[1, [v - 2, v // 2]] = float("nan")  # the first NaN: v // 2
        x[1, 0] = float("inf")
    if b > 2:
        x[2] = float("-inf")
    if b > 3:
        x[3, v - 1] = float("inf")  # the maximum in the partial last chunk
    return x.to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b,v", [(1, 1000), (4, 777), (5, 64), (3, 63)])
def test_argmax_rows_equals_torch(dtype, b, v):
    x = _rows(b, v, seed=b * v, dtype=dtype)
    out = argmax_rows(x, BLOCK)
    assert out.dtype == torch.int64 and out.shape == (b,)
    assert out.tolist() == x.cpu().argmax(-1).tolist()
    if b > 1:
        assert out[1] == v // 2 and out[0] == 5
    assert not _counters(x.device).any()  # every row's counter is zero again


def test_strided_rows_and_what_it_refuses():
    x = _rows(4, 600, seed=1, dtype=torch.float32)
    wide = torch.zeros(4, 1000, device=DEVICE)
    wide[:, :600] = x
    view = wide[:, :600]  # row stride 1000
    assert argmax_rows(view, BLOCK).tolist() == x.cpu().argmax(-1).tolist()
    assert argmax_rows(x.t()) is None  # column stride
    assert argmax_rows(torch.zeros(MAX_ROWS + 1, 8, device=DEVICE)) is None
    assert argmax_rows(torch.zeros(0, 8, device=DEVICE)) is None
    assert argmax_rows(torch.zeros(2, 8, dtype=torch.int32, device=DEVICE)) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA")
@pytest.mark.parametrize("v", [129280, 151936, 49152])
@pytest.mark.parametrize("b", [1, 64])
def test_gpu_vocabularies_and_graph_replay(v, b):
    x = _rows(b, v, seed=v, dtype=torch.bfloat16)
    assert argmax_rows(x).tolist() == x.argmax(-1).tolist()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = argmax_rows(x)
    x.copy_(_rows(b, v, seed=v + 1, dtype=torch.bfloat16).flip(-1))
    graph.replay()
    assert out.tolist() == x.argmax(-1).tolist()
