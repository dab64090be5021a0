"""Moving expert weights onto a new membership's placement (collective over the new group).

Every member contributes what it holds now (`holdings`: the logical expert of each local slot,
per layer), all agree on the moves (placement.plan_moves), and each then fills its new slots:
copies of its own, batched point-to-point receives from the members that hold an expert, and,
for experts no member holds any more, the tensors read from the checkpoint (FP8 ones as the
loader reads them: blocks and scales as stored into FP8 experts). Slots may grow
(fewer members must still hold every expert), so the stacked parameters are rebuilt.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from contextlib import ExitStack

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn

from moeserve.elastic.placement import CHECKPOINT, plan_moves
from moeserve.ep.comm import all_gather_flat
from moeserve.kernels.fp8_format import FP8
from moeserve.layers.moe import MoEExperts
from moeserve.models.loader import (
    SCALE_SUFFIX,
    WeightLoadError,
    checkpoint_files,
    dequantize_stored,
    quantize_for,
)

logger = logging.getLogger(__name__)

_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<id>\d+)\.(?P<proj>\w+)\.weight$")


def slot_params(ex: MoEExperts) -> list[str]:
    """Names of the parameters stacked per local slot ([num_local, ...])."""
    return [n for n, p in ex.named_parameters(recurse=False)
            if p.dim() > 0 and p.shape[0] == ex.num_local]


def holdings_of(experts: dict[int, MoEExperts], num_layers: int, width: int) -> torch.Tensor:
    """[L, width] int64: logical expert of each local slot per layer, -1 padded (and for
    layers without routed experts)."""
    out = torch.full((num_layers, width), -1, dtype=torch.int64)
    for layer, ex in experts.items():
        out[layer, : len(ex.slot_logical)] = torch.tensor(ex.slot_logical, dtype=torch.int64)
    return out


def gather_holdings(mine: torch.Tensor, members: int, group) -> torch.Tensor:
    """Every member's holdings: [n, L, width] (collective)."""
    out = torch.empty((members * mine.shape[0], *mine.shape[1:]), dtype=mine.dtype)
    all_gather_flat(out, mine.contiguous(), group)
    return out.view(members, *mine.shape)


def apply_placement(experts: dict[int, MoEExperts], phy2log: torch.Tensor, slots: int,
                    holdings: torch.Tensor, me: int, group, model, model_path: str) -> Counter:
    """Make this member's experts hold slots [me * slots, (me + 1) * slots) of `phy2log`
    [L, n * slots]; → counts of local / peer / checkpoint fills on this member."""
    stats: Counter = Counter()
    from_disk: dict[int, set[int]] = {}  # layer -> logical experts to read from the checkpoint
    for layer in sorted(experts):
        ex = experts[layer]
        target = phy2log[layer].tolist()
        rows = [[e for e in h] for h in holdings[:, layer].tolist()]
        moves = plan_moves(target, slots, rows)
        names = slot_params(ex)
        old = {n: getattr(ex, n).data for n in names}
        new = {n: t.new_empty((slots, *t.shape[1:])) for n, t in old.items()}
        ops, received = [], []
        for mv in moves:
            if mv.dst == me and mv.src == me:
                for n in names:
                    new[n][mv.dst_slot] = old[n][mv.src_slot]
                stats["local"] += 1
            elif mv.dst == me and mv.src == CHECKPOINT:
                from_disk.setdefault(layer, set()).add(mv.logical)
                stats["checkpoint"] += 1
            elif mv.dst == me:
                bufs = [torch.empty_like(new[n][mv.dst_slot]) for n in names]
                ops += [dist.P2POp(dist.irecv, b, mv.src, group=group) for b in bufs]
                received.append((mv.dst_slot, bufs))
                stats["peer"] += 1
            elif mv.src == me:
                ops += [dist.P2POp(dist.isend, old[n][mv.src_slot].contiguous(), mv.dst,
                                   group=group) for n in names]
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        for slot, bufs in received:
            for n, b in zip(names, bufs):
                new[n][slot] = b
        for n in names:
            param = nn.Parameter(new[n], requires_grad=False)
            param.__dict__.update(getattr(ex, n).__dict__)  # fp8_block, expected_shards, ...
            setattr(ex, n, param)
        ex.num_experts, ex.num_local, ex.first_expert = len(target), slots, me * slots
        ex.slot_logical = target[me * slots : (me + 1) * slots]
    if from_disk:
        load_from_checkpoint(experts, from_disk, model, model_path)
    return stats


def load_from_checkpoint(experts: dict[int, MoEExperts], wanted: dict[int, set[int]], model,
                         model_path: str) -> None:
    """Read the listed (layer, logical expert) tensors from the checkpoint into every local slot
    holding them (MoEExperts.weight_loader), as the loader would (models/loader.py): an FP8
    weight goes into FP8 experts as stored with its `weight_scale_inv` (no dequantize and
    requantize round trip) and is dequantized for float experts; a float weight bound for FP8
    experts is quantized on their blocks. Only the wanted tensors are read."""
    names = {id(m): name for name, m in model.named_modules()}
    by_prefix = {names[id(experts[layer])]: layer for layer in wanted}
    shards = getattr(model, "expert_weight_names", {})
    where = tensor_files(model_path)
    with ExitStack() as stack:
        opened: dict[str, object] = {}

        def read(key: str) -> torch.Tensor:
            path = where[key]
            if path not in opened:
                opened[path] = stack.enter_context(safe_open(path, framework="pt"))
            return opened[path].get_tensor(key)

        for key in where:
            m = _EXPERT.match(key)
            if m is None or m["prefix"] not in by_prefix or m["proj"] not in shards:
                continue
            layer, e, shard = by_prefix[m["prefix"]], int(m["id"]), shards[m["proj"]]
            if e not in wanted[layer]:
                continue
            ex = experts[layer]
            name = "w2" if shard == "down" else "w13"
            param, tensor = getattr(ex, name), read(key)
            scale = None
            if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                if key + SCALE_SUFFIX not in where:
                    raise WeightLoadError(f"FP8 tensor without weight_scale_inv: {key}")
                scale = read(key + SCALE_SUFFIX)
                if param.dtype != FP8:
                    tensor, scale = dequantize_stored(tensor, scale), None
            elif param.dtype == FP8:
                tensor, scale = quantize_for(param, tensor)
            ex.weight_loader(param, tensor.to(param.dtype), e, shard)
            if scale is not None:
                ex.weight_loader(getattr(ex, name + SCALE_SUFFIX), scale, e, shard)


def tensor_files(model_path: str) -> dict[str, str]:
    """Checkpoint tensor name -> its safetensors file (headers only; no tensor is read)."""
    out: dict[str, str] = {}
    for path in checkpoint_files(model_path):
        with safe_open(path, framework="pt") as f:
            out.update(dict.fromkeys(f.keys(), path))
    return out
