"""Checkpoint loading errors name the tensor; FP8 block dequantization; sharded indexes."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from moeserve.models.loader import WeightLoadError, dequantize_fp8_blocks, iterate_weights
from moeserve.models.registry import UnknownArchitectureError
from parity import make_runner


def _rewrite(src: str, dst: str, edit) -> str:
    os.makedirs(dst, exist_ok=True)
    for f in os.listdir(src):
        if f.endswith(".safetensors"):
            tensors = load_file(os.path.join(src, f))
            edit(tensors)
            save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(dst, f))
        elif not f.endswith(".index.json"):
            with open(os.path.join(src, f), "rb") as a, open(os.path.join(dst, f), "wb") as b:
                b.write(a.read())
    return dst


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_missing_extra_and_misshaped_tensors_are_named(tiny_model, tmp_path, arch):
    src = tiny_model(arch)
    name = "model.layers.1.self_attn.o_proj.weight"
    bad = _rewrite(src, str(tmp_path / "missing"), lambda t: t.pop(name))
    with pytest.raises(WeightLoadError, match="o_proj"):
        make_runner(bad)
    bad = _rewrite(src, str(tmp_path / "extra"), lambda t: t.update({"model.bogus.weight":
                                                                      torch.zeros(2)}))
    with pytest.raises(WeightLoadError, match="model.bogus.weight"):
        make_runner(bad)
    bad = _rewrite(src, str(tmp_path / "shape"), lambda t: t.update({name: t[name][:, :-1]}))
    with pytest.raises(WeightLoadError, match="o_proj"):
        make_runner(bad)
    proj = "model.layers.0.mlp.gate_proj.weight" if arch == "llama" else \
        "model.layers.0.mlp.experts.3.up_proj.weight"
    bad = _rewrite(src, str(tmp_path / "packed"), lambda t: t.update({proj: t[proj][:-1]}))
    with pytest.raises(WeightLoadError, match=proj.replace(".", r"\.")):
        make_runner(bad)


def test_unknown_architecture_and_missing_config(tiny_model, tmp_path):
    import json

    src = tiny_model("llama")
    dst = _rewrite(src, str(tmp_path / "arch"), lambda t: None)
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    cfg["architectures"] = ["NopeForCausalLM"]
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(UnknownArchitectureError, match="NopeForCausalLM"):
        make_runner(dst)
    with pytest.raises(FileNotFoundError, match="config.json"):
        make_runner(str(tmp_path))


def test_fp8_block_dequantization_roundtrip(tmp_path):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(200, 300, generator=g)
    blocks = torch.zeros(2, 3)
    q = torch.empty(200, 300, dtype=torch.float8_e4m3fn)
    for i in range(2):
        for j in range(3):
            tile = w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128]
            blocks[i, j] = tile.abs().max() / 448.0
            q[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] = (tile / blocks[i, j]).to(
                torch.float8_e4m3fn)
    deq = dequantize_fp8_blocks(q, blocks)
    rel = float((deq - w).norm() / w.norm())
    assert rel < 0.05, rel
    save_file({"x.weight": q, "x.weight_scale_inv": blocks, "y": torch.ones(3)},
              str(tmp_path / "model.safetensors"))
    out = dict(iterate_weights(str(tmp_path)))
    assert set(out) == {"x.weight", "y"} and torch.equal(out["x.weight"], deq)


def test_sharded_checkpoint_loads_same_weights(tiny_model, tmp_path):
    from moeserve.tools.make_tiny import make_tiny

    one = make_runner(tiny_model("qwen3"))
    sharded = make_runner(make_tiny("qwen3", str(tmp_path / "sharded"), seed=0, shard=True))
    for (n, a), (_, b) in zip(one.model.named_parameters(), sharded.model.named_parameters()):
        assert torch.equal(a, b), n


def test_fp8_blocks_of_other_sizes_and_kept_fp8(tmp_path):
    """A 64x64-block checkpoint dequantizes exactly (block read off the scale grid); with
    keep_fp8 the e4m3 tensor comes as stored, followed by its scale."""
    from moeserve.kernels.fp8_format import quantize_fp8_blocks

    w = torch.randn(300, 200, generator=torch.Generator().manual_seed(2))
    q, s = quantize_fp8_blocks(w, (64, 64))
    assert s.shape == (5, 4)
    save_file({"x.weight": q, "x.weight_scale_inv": s}, str(tmp_path / "model.safetensors"))
    out = dict(iterate_weights(str(tmp_path)))
    assert torch.equal(out["x.weight"], dequantize_fp8_blocks(q, s, (64, 64)))
    kept = list(iterate_weights(str(tmp_path), keep_fp8=lambda name: name == "x.weight"))
    assert [n for n, _ in kept] == ["x.weight", "x.weight_scale_inv"]
    assert torch.equal(kept[0][1].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(kept[1][1], s)
