"""Weight bytes of a built model on this rank, by part (the start-up log and /server_info)."""

from __future__ import annotations

from torch import nn

from moeserve.kernels.fp8_format import FP8
from moeserve.layers.moe import MoEExperts

PARTS = ("attention", "mlp", "experts", "embeddings", "other")


def _part(name: str, expert_ids: set[int], tensor) -> str:
    if id(tensor) in expert_ids:
        return "experts"  # routed experts: this rank's slots, redundant ones included
    if "embed_tokens" in name or name.startswith("lm_head"):
        return "embeddings"  # embedding + LM head
    if ".self_attn." in name:
        return "attention"
    if ".mlp." in name and not name.endswith(("mlp.gate.weight", "e_score_correction_bias")):
        return "mlp"  # dense MLPs and shared experts
    return "other"  # norms, routers, rotary caches, MTP glue


def weight_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of every parameter and buffer (tied tensors once) by part — attention, mlp (dense
    and shared experts), experts (routed, FP8 scales included), embeddings (embedding and LM
    head), other — plus `total` and `fp8` (the e4m3 tensors among them)."""
    expert_ids = {id(p) for m in model.modules() if isinstance(m, MoEExperts)
                  for p in m.parameters()}
    out = dict.fromkeys((*PARTS, "total", "fp8"), 0)
    seen: set[int] = set()
    tensors = [*model.named_parameters(), *model.named_buffers()]
    for name, t in tensors:
        if id(t) in seen:
            continue
        seen.add(id(t))
        nbytes = t.numel() * t.element_size()
        out[_part(name, expert_ids, t)] += nbytes
        out["total"] += nbytes
        out["fp8"] += nbytes if t.dtype == FP8 else 0
    return out
