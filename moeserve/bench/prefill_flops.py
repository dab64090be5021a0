"""Prefill FLOPs of a model from its shape, and the matmul peak one run measures: prefill as a
share of what the GPU's tensor cores can do (bench.one_batch, bench.mla_forms).

Counted per prompt (no cached prefix): every linear of the main layers on every token
(kv_b_proj included: the MHA form decompresses each position once, the absorbed form spends
the same multiply-adds absorbing q and the output), the routed experts' three GEMMs on top_k
copies of each token, attention as the causal pairs times heads times (qk + v) dims (MLA
counted in its MHA form: nope + rope and v), and the LM head on each request's last token.
"""

from __future__ import annotations

import re

import torch

_LAYER = re.compile(r"layers\.(\d+)\.")


def _linears(model: torch.nn.Module, main_layers: int) -> tuple[int, int]:
    """(multiply-adds per token of the main layers' linears, of the LM head)."""
    body = head = 0
    for name, m in model.named_modules():
        if not (hasattr(m, "in_features") and hasattr(m, "out_features")):
            continue
        if "experts" in name.split(".")[-1] or name.endswith("experts"):
            continue
        lay = _LAYER.search(name)
        if lay and int(lay[1]) >= main_layers:  # MTP layers
            continue
        macs = m.in_features * m.out_features
        if name.endswith("lm_head"):
            head += macs
        elif lay:
            body += macs
    return body, head


def prefill_flops(runner, batch: int, input_len: int) -> float:
    """FLOPs of prefilling `batch` prompts of `input_len` tokens (module docstring)."""
    c = runner.hf_config
    layers = c.num_hidden_layers
    body, head = _linears(runner.model, layers)
    experts = runner.moe_parallel.experts_by_layer
    routed = sum(3 * e.w13.shape[-1] * e.intermediate_size for e in experts.values()) * (
        getattr(c, "num_experts_per_tok", 0) or 0)
    tokens = batch * input_len
    if getattr(c, "kv_lora_rank", None):
        qk, v = c.qk_nope_head_dim + c.qk_rope_head_dim, c.v_head_dim
    else:
        qk = v = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    pairs = batch * input_len * (input_len + 1) / 2
    attn = layers * pairs * c.num_attention_heads * (qk + v)
    return 2.0 * (tokens * (body + routed) + attn + batch * head)


def measure_matmul_peak(device: torch.device, dtype: torch.dtype = torch.bfloat16,
                        n: int = 8192, iters: int = 20) -> float:
    """FLOP/s of an n x n x n matmul in `dtype` (median of `iters` after a warm-up), on random
    inputs rotated among three sets (METHOD: not zeros, not one cached set)."""
    sets = [(torch.randn(n, n, device=device, dtype=dtype),
             torch.randn(n, n, device=device, dtype=dtype)) for _ in range(3)]
    out = torch.empty(n, n, device=device, dtype=dtype)
    for a, b in sets:
        torch.mm(a, b, out=out)
    times = []
    for i in range(iters):
        a, b = sets[i % 3]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.mm(a, b, out=out)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return 2.0 * n ** 3 / times[len(times) // 2]
