"""Elastic EP's expert re-placement (elastic/weights.py) on one member, tiny DeepSeek-V3: half the
experts are kept (local copies), the other half are gone and must be read back from the
checkpoint, FP8 ones as the loader reads them. The oracle is the model the ordinary loader built
before the move: every new slot must equal, bit for bit (e4m3 bytes and block scales included),
the slot that held the same logical expert then."""

from __future__ import annotations

import pytest
import torch
from parity import make_runner

from moeserve.elastic.weights import apply_placement, slot_params
from moeserve.kernels.fp8_format import FP8
from moeserve.tools.make_tiny import make_tiny


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    d = tmp_path_factory.mktemp("elastic_fp8")
    return {"f32": make_tiny("deepseek_v3", str(d / "f32"), seed=5),
            "fp8": make_tiny("deepseek_v3", str(d / "fp8"), seed=5, fp8=True)}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8 else t


@pytest.mark.parametrize("ckpt, quantization, resident", [
    ("fp8", "fp8", True),  # e4m3 blocks and scales loaded as stored
    ("fp8", "auto", False),  # dequantized on CPU, as at start-up
    ("f32", "fp8", True),  # a float checkpoint quantized on the experts' blocks
])
def test_experts_reloaded_from_checkpoint_equal_the_loaded_ones(checkpoints, ckpt, quantization,
                                                                resident):
    path = checkpoints[ckpt]
    runner = make_runner(path, [f"model.quantization={quantization}"])
    experts = runner.moe_parallel.experts_by_layer
    assert experts
    before = {layer: {n: getattr(ex, n).data.clone() for n in slot_params(ex)}
              for layer, ex in experts.items()}
    for ex in experts.values():
        assert (ex.w13.dtype == FP8) == resident and ex.slot_logical == list(range(ex.num_local))
    num_layers = max(experts) + 1
    e = next(iter(experts.values())).num_local
    kept = e // 2
    holdings = torch.full((1, num_layers, e), -1, dtype=torch.int64)
    holdings[0, :, :kept] = torch.arange(kept)  # slots >= kept hold nothing any more
    phy2log = torch.arange(e).flip(0).expand(num_layers, e).clone()  # every expert moves
    stats = apply_placement(experts, phy2log, e, holdings, 0, None, runner.model, path)
    assert stats == {"local": kept * len(experts), "checkpoint": (e - kept) * len(experts)}
    for layer, ex in experts.items():
        assert ex.slot_logical == phy2log[layer].tolist()
        names = slot_params(ex)
        assert len(names) == (4 if resident else 2)  # the block scales move with their slots
        for n in names:
            now = getattr(ex, n).data
            for slot, logical in enumerate(ex.slot_logical):
                assert torch.equal(_bits(now[slot]), _bits(before[layer][n][logical])), \
                    (layer, n, slot, logical)
