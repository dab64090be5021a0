"""The memory roofline of a decode step: the fewest HBM bytes it must move, over measured bandwidth.

A decode step reads every weight once (the routed experts only where some token of the step was
routed to them), each request's whole KV once, and writes the logits; activations are small next
to these. Expert use is counted from a real decode step through the EPLB recorder, so the figure
reflects the experts actually routed to, not an estimate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeserve.layers.moe import MoEExperts


@dataclass(frozen=True)
class StepBytes:
    """Bytes one decode step must move, by part."""

    weights: int  # every non-expert weight (attention, dense MLPs, shared experts, norms, LM head)
    experts: int  # the routed experts the step's tokens were sent to
    kv: int  # every request's KV, all layers, read once
    io: int  # embedding rows read + logits written

    @property
    def total(self) -> int:
        return self.weights + self.experts + self.kv + self.io


def measure_copy_bandwidth(device: torch.device, nbytes: int = 1 << 31, iters: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    src = torch.empty(nbytes // 2, dtype=torch.int16, device=device).random_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return 2 * src.nbytes / times[len(times) // 2]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def dense_weight_bytes(model: torch.nn.Module, num_main_layers: int | None = None) -> int:
    """Every parameter but routed experts and the embedding table (a step reads B rows of it);
    tied weights count once; the MTP layer (built past the main layers) is not run."""
    seen, total = set(), 0
    expert_params = {id(p) for m in model.modules() if isinstance(m, MoEExperts)
                     for p in m.parameters()}
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    head = getattr(model, "lm_head", None)
    for name, p in model.named_parameters():
        if id(p) in seen or id(p) in expert_params or _is_mtp(name, num_main_layers):
            continue
        seen.add(id(p))
        if embed is not None and p is embed.weight and (head is None or head.weight is not p):
            continue
        total += _nbytes(p)
    return total


def _is_mtp(name: str, num_main_layers: int | None) -> bool:
    parts = name.split(".")
    if num_main_layers is None or len(parts) < 3 or parts[:2] != ["model", "layers"]:
        return False
    return parts[2].isdigit() and int(parts[2]) >= num_main_layers


def expert_bytes(experts_by_layer: dict[int, MoEExperts], touched: torch.Tensor | None) -> int:
    """Bytes of the routed experts in `touched` ([L, P] bool: layer l's physical slot p got a
    token), counted for this rank's local slots (`MoEParallel.experts_by_layer`)."""
    if touched is None:
        return 0
    total = 0
    for layer, m in experts_by_layer.items():
        if layer >= touched.shape[0]:
            continue
        per_expert = sum(_nbytes(p) for p in m.expert_params()) // m.num_local  # FP8: + scales
        local = touched[layer, m.first_expert : m.first_expert + m.num_local]
        total += int(local.sum()) * per_expert
    return total


def kv_bytes_per_token(pool) -> int:
    """KV bytes of one token over all layers of `pool` (MHA: k + v; MLA: one latent)."""
    buffers = getattr(pool, "kv", None) or [*pool.k, *pool.v]
    return sum(_nbytes(b[0]) for b in buffers)


def step_bytes(runner, batch: int, seq_len: float, touched: torch.Tensor | None) -> StepBytes:
    """The decode step's bytes at `batch` requests of mean length `seq_len`."""
    cfg, model = runner.hf_config, runner.model
    elem = torch.empty((), dtype=runner.dtype).element_size()
    num_main = getattr(getattr(model, "model", None), "num_main_layers", None)
    io = batch * cfg.hidden_size * elem + batch * cfg.vocab_size * elem
    return StepBytes(weights=dense_weight_bytes(model, num_main),
                     experts=expert_bytes(runner.moe_parallel.experts_by_layer, touched),
                     kv=int(batch * seq_len * kv_bytes_per_token(runner.memory.pool)), io=io)


def touched_experts(runner, fb) -> torch.Tensor | None:
    """[L, P] bool: the experts one eager step of `fb` routes to; None for a model without an
    EPLB recorder."""
    def step():
        with torch.inference_mode():
            runner.forward_hidden(fb)
    counts = routed_counts(runner, step)
    return None if counts is None else counts > 0


def routed_counts(runner, fn) -> torch.Tensor | None:
    """[L, P] int64: token pairs each expert received while `fn()` ran its forwards (recorded
    through the EPLB recorder, in CUDA-graph replays too, and then put back as it was); None for
    a model without one."""
    rec = runner.recorder
    if rec is None:
        return None
    was = rec.recording
    before = rec.physical_counts().clone()
    rec.start()
    fn()
    counts = rec.physical_counts() - before
    if not was:
        rec.stop()
    return counts


def routing_line(counts: torch.Tensor, tokens: int, label: str) -> str:
    """One table line on how `tokens` tokens spread over the experts of each MoE layer (counts
    [L, P]): dummy weights route deep layers' tokens to a few experts (docs/gpu_decode.md)."""
    moe = counts[counts.sum(1) > 0].float()
    if moe.numel() == 0:
        return f"| {label}: no MoE layer recorded"
    used = (moe > 0).sum(1)
    top = moe.max(1).values / tokens
    return (f"| {label}: experts used a MoE layer {int(used.min())}-{int(used.max())} (median "
            f"{int(used.median())}) of {counts.shape[1]}; the busiest takes "
            f"{100 * float(top.min()):.0f}-{100 * float(top.max()):.0f}% of the {tokens} tokens")
