"""ForwardBatch: the tensors of one model forward, built by the runtime, read by models and backends."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from moeserve.core import ForwardMode
from moeserve.host_copy import to_device

if TYPE_CHECKING:
    from moeserve.attention.base import AttentionBackend
    from moeserve.kvcache.pool import KVPool
    from moeserve.kvcache.table import ReqToTokenPool


@dataclass
class ForwardBatch:
    """One forward step over B requests and T = sum(extend_seq_lens) new tokens.

    Token-major tensors are [T]; request-major ones are [B]. For DECODE, extend_seq_lens are all 1 and
    extend_prefix_lens = seq_lens - 1. `out_cache_loc[t]` is the KV slot that token t writes.
    """

    forward_mode: ForwardMode
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    out_cache_loc: torch.Tensor  # [T]
    req_pool_indices: torch.Tensor  # [B]
    seq_lens: torch.Tensor  # [B] total length after this step
    seq_lens_cpu: list[int]
    extend_prefix_lens_cpu: list[int]  # [B] tokens already in the KV cache
    extend_seq_lens_cpu: list[int]  # [B] new tokens this step
    req_to_token_pool: ReqToTokenPool
    kv_pool: KVPool
    attn_backend: AttentionBackend
    return_all_logits: bool = False  # prefill logits at every position (tests, logprobs)
    global_forward_mode: ForwardMode | None = None  # across DP ranks: EXTEND if any rank extends
    global_num_tokens: list[int] | None = None  # every rank's token count (DP sync), for EP
    attn_metadata: object = field(default=None, repr=False)  # filled by the backend
    tbo: bool = False  # run as two overlapped micro-batches (every rank agreed in the DP sync)
    # one half of a two-batch-overlap step (tbo/split.py): backends keep no cross-step state for it
    micro_batch: bool = False
    # [B] int64 on the host, or None: how many leading positions each row shares with the first
    # row of its run (0 starts one). A speculative verify's rows of one request share the prefix;
    # the CPU decode kernel then reads it once per run (GPU backends ignore it).
    shared_prefix: torch.Tensor | None = None
    # MLA: > 0 runs attention in the MHA form, decompressing this many KV positions at once
    # (attention/mla_mha.py; chosen by the runner from attention.mla_form); 0: absorbed
    mla_mha_chunk: int = 0
    mla_plan: object = field(default=None, repr=False)  # the MHA form's plan, built once a step
    # an SdpaStep: the step's fresh requests attend with torch SDPA and the step runs eager
    # (attention/sdpa_prefill.py; chosen by the runner from attention.sdpa_prefill_*); None: not
    sdpa_prefill: object = field(default=None, repr=False)

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    def last_token_indices(self) -> torch.Tensor:
        """Index of each request's last new token in the token-major tensors: [B]."""
        ends = torch.tensor(self.extend_seq_lens_cpu, dtype=torch.int64).cumsum(0) - 1
        return to_device(ends, self.input_ids.device)
