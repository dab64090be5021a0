"""Checkpoint reading (safetensors, sharded index, DeepSeek FP8 blocks) and declarative loading.

Models declare how checkpoint names map onto their parameters:
- `packed_modules_mapping = {"q_proj": ("qkv_proj", "q"), ...}`: a checkpoint module merged into a
  parameter of another name, loaded through `param.weight_loader(param, tensor, shard_id)`;
- `expert_weight_names = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}`: per-expert
  tensors `...experts.{i}.{proj}.weight` stacked into `...experts.w13` / `...experts.w2`;
- `skip_weight(name) -> bool`: tensors that are deliberately not loaded.
Every other tensor must match a parameter by name and shape; anything left over is an error.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from moeserve.kernels.fp8_format import dequantize_fp8_blocks  # noqa: F401 (re-exported)

_EXPERT_RE = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<id>\d+)\.(?P<proj>\w+)\.weight$")


class WeightLoadError(RuntimeError):
    """A checkpoint that does not fit the model; the message names the tensor or file."""


def checkpoint_files(path: str) -> list[str]:
    """The safetensors files of a checkpoint folder (single file or sharded index)."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(path, s) for s in shards]
    else:
        files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise WeightLoadError(f"no *.safetensors files in {path}")
    missing = [f for f in files if not os.path.exists(f)]
    if missing:
        raise WeightLoadError(f"checkpoint file listed in the index is missing: {missing[0]}")
    return files


def iterate_weights(path: str, dtype: torch.dtype | None = None, progress: bool = True
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor), in `dtype` if given (else as stored, so that copying into a float32
    parameter such as a router bias keeps full precision); FP8 weights with `weight_scale_inv`
    come out dequantized."""
    files = checkpoint_files(path)
    pending_fp8: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    for file in tqdm(files, desc="loading weights", disable=not progress or len(files) < 2):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                if name.endswith(".weight_scale_inv"):
                    scales[name[: -len("_scale_inv")]] = tensor
                elif tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                    pending_fp8[name] = tensor
                else:
                    yield name, tensor if dtype is None else tensor.to(dtype)
                yield from _ready_fp8(pending_fp8, scales, dtype)
    if pending_fp8:
        raise WeightLoadError(f"FP8 tensor without weight_scale_inv: {next(iter(pending_fp8))}")


def _ready_fp8(pending: dict, scales: dict, dtype: torch.dtype):
    for name in [n for n in pending if n in scales]:
        w = dequantize_fp8_blocks(pending.pop(name), scales.pop(name))
        yield name, w if dtype is None else w.to(dtype)


def load_weights(model: nn.Module, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Load checkpoint tensors into `model` following its declarations (see module docstring)."""
    params = dict(model.named_parameters())
    seen: dict[str, set] = {}  # parameter → shard keys loaded into it
    skip = getattr(model, "skip_weight", lambda name: False)
    for name, tensor in weights:
        if skip(name):
            continue
        try:
            target, shard_key = _load_one(model, params, name, tensor)
        except ValueError as e:  # a weight_loader's shape check
            raise WeightLoadError(f"cannot load checkpoint tensor {name!r}: {e}") from e
        seen.setdefault(target, set()).add(shard_key)
    for target, param in params.items():
        expected = getattr(param, "expected_shards", {None})
        lacking = expected - seen.get(target, set())
        if lacking:
            what = "" if lacking == {None} else f" (shard {sorted(lacking, key=str)[0]})"
            raise WeightLoadError(f"checkpoint has no tensor for parameter {target!r}{what}")


def _load_one(model: nn.Module, params: dict, name: str, tensor: torch.Tensor) -> tuple[str, object]:
    """Load one tensor; returns (parameter name, shard key) for completeness checking."""
    m = _EXPERT_RE.match(name)
    expert_names = getattr(model, "expert_weight_names", {})
    if m and m["proj"] in expert_names:
        shard = expert_names[m["proj"]]
        target = f"{m['prefix']}.{'w2' if shard == 'down' else 'w13'}"
        param = _param(params, target, name)
        param.weight_loader(param, tensor, int(m["id"]), shard)
        return target, (int(m["id"]), shard)
    for ckpt_part, (param_part, shard) in getattr(model, "packed_modules_mapping", {}).items():
        if f".{ckpt_part}." in name:
            target = name.replace(f".{ckpt_part}.", f".{param_part}.")
            param = _param(params, target, name)
            param.weight_loader(param, tensor, shard)
            return target, shard
    param = _param(params, name, name)
    if param.shape != tensor.shape:
        raise WeightLoadError(f"shape mismatch for {name!r}: checkpoint {tuple(tensor.shape)}, "
                              f"model {tuple(param.shape)}")
    loader = getattr(param, "weight_loader", None)
    if loader is not None and not hasattr(loader, "__self__"):
        loader(param, tensor)
    else:
        param.data.copy_(tensor)
    return name, None


def _param(params: dict, target: str, ckpt_name: str) -> nn.Parameter:
    if target not in params:
        raise WeightLoadError(f"unexpected checkpoint tensor {ckpt_name!r} (no parameter {target!r})")
    return params[target]
