"""A rank's KV memory (request table, slot allocator, per-layer pool) and how big it is made."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from moeserve.config import ConfigError, MoeserveConfig
from moeserve.kvcache.allocator import TokenToKVPoolAllocator
from moeserve.kvcache.pool import KVPool, MHAKVPool, MLAKVPool
from moeserve.kvcache.table import ReqToTokenPool

logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_TOKENS = 16384
MIN_CUDA_KV_TOKENS = 1024


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


def kv_bytes_per_token(layout: dict, dtype: torch.dtype) -> int:
    width = (layout["kv_lora_rank"] + layout["rope_dim"] if layout["kind"] == "mla"
             else layout["kv_heads"] * (layout["head_dim"] + layout["v_head_dim"]))
    return KVPool.bytes_per_token(layout["layers"], width, dtype)


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def kv_tokens(cfg: MoeserveConfig, layout: dict, dtype: torch.dtype, device: torch.device,
              reserve: int = 0) -> int:
    """The pool's size in tokens. CPU: cache.max_total_tokens or a fixed size. CUDA: the
    configured size, checked, or what is free beyond (1 - cache.mem_fraction_static) of the GPU;
    either way `reserve` bytes (the largest step's activations: runtime/step_memory.py) stay
    free. A size that cannot fit raises a ConfigError with the bytes needed and free."""
    asked = cfg.cache.max_total_tokens
    if device.type == "cpu":
        return asked or CPU_DEFAULT_KV_TOKENS
    per_token = kv_bytes_per_token(layout, dtype)
    free, total = torch.cuda.mem_get_info(device)
    if asked is not None:
        need = asked * per_token
        if need + reserve > free:
            raise ConfigError("cache.max_total_tokens", (
                f"{asked} tokens of KV need {_gib(need)} ({per_token} bytes a token), and the "
                f"largest step's activations {_gib(reserve)}: {_gib(need + reserve)} in all, "
                f"but the GPU has {_gib(free)} free after the weights (of {_gib(total)}); at "
                f"most {max(int((free - reserve) // per_token), 0)} tokens fit"))
        return asked
    budget = free - total * (1.0 - cfg.cache.mem_fraction_static) - reserve
    floor = MIN_CUDA_KV_TOKENS * per_token
    if budget < floor and free - reserve >= floor:
        # NOTE: other users of this GPU (a test process's earlier models) hold what the fraction
        # counts on; the smallest pool still fits beside the reserve
        logger.warning("KV pool: %s free is under what cache.mem_fraction_static=%s keeps back; "
                       "using the minimum %d tokens", _gib(free), cfg.cache.mem_fraction_static,
                       MIN_CUDA_KV_TOKENS)
        return MIN_CUDA_KV_TOKENS
    if budget < floor:
        raise ConfigError("cache.mem_fraction_static", (
            f"{_gib(free)} free after the weights, less {_gib(total * (1 - cfg.cache.mem_fraction_static))} "
            f"kept back and {_gib(reserve)} for the largest step's activations, leaves "
            f"{_gib(max(budget, 0))} for KV: under the {MIN_CUDA_KV_TOKENS} tokens "
            f"({_gib(MIN_CUDA_KV_TOKENS * per_token)}) a pool needs"))
    return int(budget // per_token)


def init_kv_memory(cfg: MoeserveConfig, layout: dict, context_len: int, dtype: torch.dtype,
                   device: torch.device, spec_width: int = 0,
                   scratch_rows: int = 0, reserve: int = 0) -> tuple[KVMemory, int]:
    """(memory, context length capped at the pool's size). spec_width: positions a speculative
    verify step reads and writes past a request's last token (its verify width; 0 without);
    scratch_rows: table rows for a draft tree's nodes; reserve: bytes the pool leaves free for
    a step's activations (`kv_tokens`)."""
    size = kv_tokens(cfg, layout, dtype, device, reserve)
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
