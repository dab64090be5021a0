"""A rank's KV memory (request table, slot allocator, per-layer pool) and how big it is made."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from moeserve.config import MoeserveConfig
from moeserve.kvcache.allocator import TokenToKVPoolAllocator
from moeserve.kvcache.pool import KVPool, MHAKVPool, MLAKVPool
from moeserve.kvcache.table import ReqToTokenPool

logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_TOKENS = 16384


@dataclass
class KVMemory:
    """The per-rank KV memory: request table, slot allocator and the per-layer pool."""

    req_to_token: ReqToTokenPool
    allocator: TokenToKVPoolAllocator
    pool: KVPool


def kv_layout(model: torch.nn.Module, hf_config, draft=None) -> dict:
    """The model's own layout (MLA models declare one), else MHA from the config; a NextN draft
    head adds its KV layers."""
    if hasattr(model, "kv_layout"):
        return model.kv_layout()
    c = hf_config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    extra = draft.extra_kv_layers if draft is not None else 0
    return {"kind": "mha", "layers": c.num_hidden_layers + extra,
            "kv_heads": c.num_key_value_heads, "head_dim": head_dim, "v_head_dim": head_dim}


def auto_kv_tokens(cfg: MoeserveConfig, layout: dict, dtype: torch.dtype,
                   device: torch.device) -> int:
    """CPU: a fixed size; CUDA: what is free beyond (1 - cache.mem_fraction_static) of the GPU."""
    if device.type == "cpu":
        return CPU_DEFAULT_KV_TOKENS
    width = (layout["kv_lora_rank"] + layout["rope_dim"] if layout["kind"] == "mla"
             else layout["kv_heads"] * (layout["head_dim"] + layout["v_head_dim"]))
    per_token = KVPool.bytes_per_token(layout["layers"], width, dtype)
    free, total = torch.cuda.mem_get_info(device)
    budget = free - total * (1.0 - cfg.cache.mem_fraction_static)
    return max(int(budget // per_token), 1024)


def init_kv_memory(cfg: MoeserveConfig, layout: dict, context_len: int, dtype: torch.dtype,
                   device: torch.device, spec_width: int = 0,
                   scratch_rows: int = 0) -> tuple[KVMemory, int]:
    """(memory, context length capped at the pool's size). spec_width: positions a speculative
    verify step reads and writes past a request's last token (its verify width; 0 without);
    scratch_rows: table rows for a draft tree's nodes."""
    size = cfg.cache.max_total_tokens or auto_kv_tokens(cfg, layout, dtype, device)
    context_len = min(context_len, size)
    table = ReqToTokenPool(cfg.cache.max_running_requests + 1, context_len + spec_width, device,
                           scratch_rows)
    allocator = TokenToKVPoolAllocator(size)
    if layout["kind"] == "mla":
        pool = MLAKVPool(size, layout["layers"], layout["kv_lora_rank"], layout["rope_dim"],
                         dtype, device)
    else:
        pool = MHAKVPool(size, layout["layers"], layout["kv_heads"], layout["head_dim"],
                         layout["v_head_dim"], dtype, device)
    logger.info("KV pool: %d tokens (%s)", size, layout["kind"])
    return KVMemory(table, allocator, pool), context_len
