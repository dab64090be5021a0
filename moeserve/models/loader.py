"""Checkpoint reading (safetensors, sharded index, DeepSeek FP8 blocks) and declarative loading.

Models declare how checkpoint names map onto their parameters:
- `packed_modules_mapping = {"q_proj": ("qkv_proj", "q"), ...}`: a checkpoint module merged into a
  parameter of another name, loaded through `param.weight_loader(param, tensor, shard_id)`;
- `expert_weight_names = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}`: per-expert
  tensors `...experts.{i}.{proj}.weight` stacked into `...experts.w13` / `...experts.w2`;
- `skip_weight(name) -> bool`: tensors that are deliberately not loaded.
Every other tensor must match a parameter by name and shape; anything left over is an error.

FP8 (DeepSeek block format): a checkpoint's e4m3 weight and its `weight_scale_inv` are dequantized
while read, unless `keep_fp8` says the parameter it loads into is FP8 (layers/fp8_linear.py,
layers/fp8_moe.py): then both load as stored. A float tensor bound for an FP8 parameter is
quantized into that parameter's blocks first (`model.quantization=fp8`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Callable, Iterator

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from moeserve.kernels.fp8_format import FP8, dequantize_fp8_blocks, quantize_fp8_blocks

_EXPERT_RE = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<id>\d+)\.(?P<proj>\w+)"
                        r"\.(?P<kind>weight|weight_scale_inv)$")
SCALE_SUFFIX = "_scale_inv"  # x.weight → x.weight_scale_inv


class WeightLoadError(RuntimeError):
    """A checkpoint that does not fit the model; the message names the tensor or file."""


# torch.nn.init's random fills, as nn.Linear / nn.Embedding's reset_parameters call them
_RANDOM_INITS = ("uniform_", "normal_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_",
                 "xavier_uniform_", "xavier_normal_")


@contextlib.contextmanager
def no_random_init() -> Iterator[None]:
    """Build a model without torch's random parameter fills: every parameter is then filled
    from the checkpoint (`load_weights` is strict) or by load_format=dummy's own seeded fill, so
    the draws were waste (SmolLM2-135M: ~1.1 s of one core at each start). Not thread-safe: it
    swaps torch.nn.init's functions while the block runs (a model is built on one thread)."""
    saved = {name: getattr(nn.init, name) for name in _RANDOM_INITS}
    for name in _RANDOM_INITS:
        setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


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


def iterate_weights(path: str, dtype: torch.dtype | None = None, progress: bool = True,
                    keep_fp8: Callable[[str], bool] | None = None
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor), in `dtype` if given (else as stored, so that copying into a float32
    parameter such as a router bias keeps full precision); FP8 weights with `weight_scale_inv`
    come out dequantized, except e4m3 ones where `keep_fp8(name)`: those come as stored, each
    followed by its scale (`name + "_scale_inv"`)."""
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
                yield from _ready_fp8(pending_fp8, scales, dtype, keep_fp8)
    if pending_fp8:
        raise WeightLoadError(f"FP8 tensor without weight_scale_inv: {next(iter(pending_fp8))}")


def _ready_fp8(pending: dict, scales: dict, dtype: torch.dtype | None,
               keep_fp8: Callable[[str], bool] | None):
    for name in [n for n in pending if n in scales]:
        w, scale = pending.pop(name), scales.pop(name)
        if keep_fp8 is not None and w.dtype == FP8 and keep_fp8(name):
            yield name, w
            yield name + SCALE_SUFFIX, scale
            continue
        w = dequantize_stored(w, scale)
        yield name, w if dtype is None else w.to(dtype)


def dequantize_stored(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """A checkpoint's e4m3 weight and its `weight_scale_inv` as float32 (block from the grid)."""
    return dequantize_fp8_blocks(w, scale, _block_of(w, scale))


def _block_of(w: torch.Tensor, scale: torch.Tensor) -> tuple[int, int]:
    """The (rows, cols) block a scale grid implies: 128 unless the grid needs another power of
    two (a checkpoint with another `weight_block_size`)."""
    def fit(size: int, blocks: int) -> int:
        b = 128 if -(-size // 128) == blocks else 16
        while -(-size // b) > blocks:
            b *= 2
        return b

    return fit(w.shape[0], scale.shape[0]), fit(w.shape[1], scale.shape[1])


def load_weights(model: nn.Module, weights: Iterator[tuple[str, torch.Tensor]],
                 strict: bool = True) -> None:
    """Load checkpoint tensors into `model` following its declarations (see module docstring);
    `strict`: every parameter must have been filled."""
    params = dict(model.named_parameters())
    seen: dict[str, set] = {}  # parameter → shard keys loaded into it
    skip = getattr(model, "skip_weight", lambda name: False)
    for name, tensor in weights:
        if skip(name):
            continue
        for part_name, part in _quantize_for(params, model, name, tensor):
            try:
                target, shard_key = _load_one(model, params, part_name, part)
            except ValueError as e:  # a weight_loader's shape check
                raise WeightLoadError(f"cannot load checkpoint tensor {name!r}: {e}") from e
            seen.setdefault(target, set()).add(shard_key)
    for target, param in params.items() if strict else ():
        expected = getattr(param, "expected_shards", {None})
        lacking = expected - seen.get(target, set())
        if lacking:
            what = "" if lacking == {None} else f" (shard {sorted(lacking, key=str)[0]})"
            raise WeightLoadError(f"checkpoint has no tensor for parameter {target!r}{what}")


def target_of(model: nn.Module, name: str) -> str:
    """The parameter name a checkpoint tensor loads into (expert stacks, packed modules)."""
    return _resolve(model, name)[0]


def fp8_target(model: nn.Module, params: dict) -> Callable[[str], bool]:
    """keep_fp8 for iterate_weights: the checkpoint weight loads into an FP8 parameter."""
    def keep(name: str) -> bool:
        param = params.get(target_of(model, name))
        return param is not None and param.dtype == FP8

    return keep


def _quantize_for(params: dict, model: nn.Module, name: str, tensor: torch.Tensor):
    """[(name, tensor)], or a float weight bound for an FP8 parameter as its e4m3 blocks and
    their scales [(name, w_q), (name + "_scale_inv", scale)], quantized on the parameter's
    device."""
    param = params.get(target_of(model, name))
    if param is None or param.dtype != FP8 or tensor.dtype == FP8 or not name.endswith(".weight"):
        return [(name, tensor)]
    w_q, scale = quantize_for(param, tensor)
    return [(name, w_q), (name + SCALE_SUFFIX, scale)]


def quantize_for(param: torch.Tensor, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight bound for FP8 `param`: its e4m3 blocks and scales, on param's device."""
    return quantize_fp8_blocks(tensor.to(param.device), param.fp8_block)


def _resolve(model: nn.Module, name: str) -> tuple[str, tuple]:
    """(parameter name, how): ("expert", id, shard) | ("packed", shard) | ("plain",)."""
    m = _EXPERT_RE.match(name)
    expert_names = getattr(model, "expert_weight_names", {})
    if m and m["proj"] in expert_names:
        shard = expert_names[m["proj"]]
        suffix = SCALE_SUFFIX if m["kind"] == "weight_scale_inv" else ""
        return f"{m['prefix']}.{'w2' if shard == 'down' else 'w13'}{suffix}", ("expert",
                                                                                int(m["id"]), shard)
    for ckpt_part, (param_part, shard) in getattr(model, "packed_modules_mapping", {}).items():
        if f".{ckpt_part}." in name:
            return name.replace(f".{ckpt_part}.", f".{param_part}."), ("packed", shard)
    return name, ("plain",)


def _load_one(model: nn.Module, params: dict, name: str, tensor: torch.Tensor) -> tuple[str, object]:
    """Load one tensor; returns (parameter name, shard key) for completeness checking."""
    target, how = _resolve(model, name)
    param = _param(params, target, name)
    if param.dtype == FP8 and tensor.dtype != FP8:
        raise WeightLoadError(f"checkpoint tensor {name!r} is {tensor.dtype}, parameter "
                              f"{target!r} is FP8 (e4m3)")
    if how[0] == "expert":
        param.weight_loader(param, tensor, how[1], how[2])
        return target, (how[1], how[2])
    if how[0] == "packed":
        param.weight_loader(param, tensor, how[1])
        return target, how[1]
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
