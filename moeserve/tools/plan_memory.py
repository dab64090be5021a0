"""Per-GPU memory plan of a deployment, from its composed config and the model's config.json alone.

    python -m moeserve.tools.plan_memory +deploy=deepseek_v3_1x8 model.path=DIR [--gpu-gib 141]

Prints, for one rank, the weights by part (attention, dense MLPs, routed experts including the
redundant EPLB slots, shared experts, embedding and LM head), the KV bytes per token, the KV token
capacity at `cache.mem_fraction_static`, and whether it fits: for FP8 block-quantized weights
(e4m3, one float32 scale per 128x128 block, as DeepSeek's checkpoints) and for bf16, side by side,
which shows why DeepSeek-V3 needs FP8 on 8 GPUs. Layout as the runtime builds it: attention, dense
layers, embedding and LM head are replicated on every DP rank; routed experts are spread over
ep_size ranks; the MTP layer counts when `model.load_mtp` is set.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from moeserve.config import MoeserveConfig, compose

GIB = 1 << 30
H200_GIB = 143771 / 1024  # one H200 as nvidia-smi reports it (143771 MiB)
BLOCK = 128  # DeepSeek FP8 weight blocks are 128 x 128 with one float32 scale each


def matrix_bytes(rows: int, cols: int, fmt: str) -> int:
    """One weight matrix: bf16, or fp8 plus a float32 scale per BLOCK x BLOCK block."""
    if fmt == "bf16":
        return rows * cols * 2
    return rows * cols + math.ceil(rows / BLOCK) * math.ceil(cols / BLOCK) * 4


@dataclass(frozen=True)
class RankPlan:
    fmt: str
    attention: int
    dense: int
    experts: int
    shared: int
    embeddings: int
    norms: int
    kv_per_token: int
    budget: int  # bytes of the GPU the runtime may use (mem_fraction_static)

    @property
    def weights(self) -> int:
        return (self.attention + self.dense + self.experts + self.shared + self.embeddings
                + self.norms)

    @property
    def kv_tokens(self) -> int:
        return max(self.budget - self.weights, 0) // self.kv_per_token

    @property
    def fits(self) -> bool:
        return self.weights < self.budget


def _attention_matrices(c) -> list[tuple[int, int, bool]]:
    """(rows, cols, FP8-able) of one layer's attention projections: MLA for DeepSeek, else GQA.
    MLA's kv_b_proj is FP8-resident too, plus a bf16 copy for more than one token
    (models/quantization.py, MLAttention.after_load)."""
    h = c.hidden_size
    if getattr(c, "kv_lora_rank", None):
        heads, qk = c.num_attention_heads, c.qk_nope_head_dim + c.qk_rope_head_dim
        q = ([(c.q_lora_rank, h, True), (heads * qk, c.q_lora_rank, True)] if c.q_lora_rank
             else [(heads * qk, h, True)])
        kv = [(c.kv_lora_rank + c.qk_rope_head_dim, h, True),
              (heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank, True)]
        return q + kv + [(h, heads * c.v_head_dim, True)]
    d = getattr(c, "head_dim", None) or h // c.num_attention_heads
    q, kv = c.num_attention_heads * d, c.num_key_value_heads * d
    return [(q, h, True), (kv, h, True), (kv, h, True), (h, q, True)]  # q, k, v blocked apart


def _moe_layers(c, layers: int) -> int:
    if getattr(c, "n_routed_experts", None):
        first = getattr(c, "first_k_dense_replace", 0) or 0
        freq = getattr(c, "moe_layer_freq", 1) or 1
        return sum(1 for i in range(layers) if i >= first and i % freq == 0)
    if getattr(c, "num_experts", None) or getattr(c, "num_local_experts", None):
        return layers
    return 0


def _kv_bytes_per_token(c, layers: int) -> int:
    if getattr(c, "kv_lora_rank", None):
        return layers * (c.kv_lora_rank + c.qk_rope_head_dim) * 2
    d = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return layers * 2 * c.num_key_value_heads * d * 2


def plan_rank(cfg: MoeserveConfig, c, fmt: str, gpu_bytes: int) -> RankPlan:
    """One rank's memory in format `fmt` (fp8 | bf16); the KV and norms stay bf16/float32."""
    layers = c.num_hidden_layers + int(cfg.model.load_mtp)
    moe = _moe_layers(c, layers)
    h = c.hidden_size
    attention = layers * sum(matrix_bytes(r, k, fmt if fp8_able else "bf16")
                             for r, k, fp8_able in _attention_matrices(c))
    if fmt == "fp8" and getattr(c, "kv_lora_rank", None):  # kv_b's bf16 copy (MLAttention)
        attention += layers * c.num_attention_heads * (
            c.qk_nope_head_dim + c.v_head_dim) * c.kv_lora_rank * 2
    dense = (layers - moe) * 3 * matrix_bytes(c.intermediate_size, h, fmt)
    experts = shared = 0
    if moe:
        inter = c.moe_intermediate_size
        logical = (getattr(c, "n_routed_experts", None) or getattr(c, "num_experts", None)
                   or c.num_local_experts)
        physical = logical + cfg.eplb.num_redundant_experts
        per_rank = math.ceil(physical / cfg.parallel.ep)
        per_expert = 2 * matrix_bytes(inter, h, fmt) + matrix_bytes(h, inter, fmt)
        experts = moe * per_rank * per_expert
        n_shared = getattr(c, "n_shared_experts", 0) or 0
        shared = moe * 3 * matrix_bytes(inter * n_shared, h, fmt) if n_shared else 0
        gate = moe * logical * h * 4  # routers stay float32
    else:
        gate = 0
    tied = getattr(c, "tie_word_embeddings", False)
    # the embedding stays bf16; so does the LM head unless model.fp8_lm_head (untied only)
    head = 0 if tied else (matrix_bytes(c.vocab_size, h, fmt) if cfg.model.fp8_lm_head
                           else c.vocab_size * h * 2)
    embeddings = c.vocab_size * h * 2 + head
    norms = layers * 4 * h * 2 + gate
    return RankPlan(fmt, attention, dense, experts, shared, embeddings, norms,
                    _kv_bytes_per_token(c, layers),
                    int(gpu_bytes * cfg.cache.mem_fraction_static))


def format_plans(cfg: MoeserveConfig, c, plans: list[RankPlan]) -> str:
    p = cfg.parallel
    head = (f"model {cfg.model.path} ({c.num_hidden_layers} layers"
            f"{' + MTP' if cfg.model.load_mtp else ''}), dp {p.dp_size} x ep {p.ep}, "
            f"{cfg.eplb.num_redundant_experts} redundant experts, mem_fraction_static "
            f"{cfg.cache.mem_fraction_static}: per GPU")
    rows = [("attention", "attention"), ("dense MLPs", "dense"), ("routed experts", "experts"),
            ("shared experts", "shared"), ("embedding + LM head", "embeddings"),
            ("norms + routers", "norms"), ("weights total", "weights")]
    out = [head, f"| {'part':<22} | " + " | ".join(f"{q.fmt:>12}" for q in plans) + " |",
           "|" + "-" * 24 + "|" + "|".join("-" * 14 for _ in plans) + "|"]
    for label, attr in rows:
        out.append(f"| {label:<22} | " + " | ".join(
            f"{getattr(q, attr) / GIB:>8.2f} GiB" for q in plans) + " |")
    out.append(f"| {'KV bytes / token':<22} | " + " | ".join(
        f"{q.kv_per_token:>12,}" for q in plans) + " |")
    out.append(f"| {'budget (GPU x frac)':<22} | " + " | ".join(
        f"{q.budget / GIB:>8.2f} GiB" for q in plans) + " |")
    out.append(f"| {'KV token capacity':<22} | " + " | ".join(
        f"{q.kv_tokens:>12,}" for q in plans) + " |")
    out.append(f"| {'fits':<22} | " + " | ".join(
        f"{'yes' if q.fits else 'NO':>12}" for q in plans) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. +deploy=deepseek_v3_1x8")
    p.add_argument("--gpu-gib", type=float, default=H200_GIB, help="memory of one GPU")
    args = p.parse_args(argv)
    cfg = compose(args.overrides)
    if cfg.model.path is None:
        raise SystemExit("model.path=DIR is needed (a config.json is enough, e.g. from "
                         "`python -m moeserve.tools.make_random --shape deepseek_v3 --config-only`)")
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(cfg.model.path)
    gpu = int(args.gpu_gib * GIB)
    print(format_plans(cfg, c, [plan_rank(cfg, c, fmt, gpu) for fmt in ("fp8", "bf16")]))


if __name__ == "__main__":
    main()
