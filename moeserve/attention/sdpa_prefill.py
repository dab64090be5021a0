"""Fresh prefill through torch's scaled_dot_product_attention (`attention.sdpa_prefill_*`).

Why: a prompt with no cached prefix reads nothing from the pool; its keys are the step's own,
contiguous rows, which is the case vendor kernels are built for. On an H100 cuDNN's kernel
attends a causal block of Qwen3's heads 1.3-1.7x faster than our Triton extend kernel, which
gathers every key through the request's slot table (docs/gpu_decode.md, "Fresh prefill through
SDPA"). So in an EXTEND or MIXED step whose fresh requests (no cached prefix, more than one new
token) hold at least `min_tokens` new tokens, those requests attend with SDPA, one call each;
the step's other requests (prefix hits, decode riders) go through the Triton kernel as before,
their block table leaving the fresh ones out. MLA keeps its own MHA form (mla_mha.py).

The per-request calls are sized by host-side lengths, so such a step runs eager, outside the
extend graphs (the runner sets `fb.sdpa_prefill`, an SdpaStep): a long step's launches hide behind its device
time, and a graph replayed at another length would read the captured lengths.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moeserve.core import ForwardMode

SDPA_MODES = (ForwardMode.EXTEND, ForwardMode.MIXED)


def fresh_requests(new_lens: list[int], prefix_lens: list[int]) -> list[bool]:
    """Which requests of a step attend only over their own new tokens (SDPA's case)."""
    return [p == 0 and n > 1 for n, p in zip(new_lens, prefix_lens)]


@dataclass(frozen=True)
class SdpaStep:
    """A step's SDPA part (fb.sdpa_prefill): the kernel to use and which requests take it."""

    backend: str  # attention.sdpa_prefill_backend (`_backend`)
    requests: list[bool]  # per request of the step: attended by SDPA (else by the Triton kernel)


@dataclass(frozen=True)
class SdpaPrefillPolicy:
    min_tokens: int  # attention.sdpa_prefill_min_tokens
    backend: str = "auto"  # attention.sdpa_prefill_backend (`_backend`)

    def step(self, mode: ForwardMode, new_lens: list[int], prefix_lens: list[int]
             ) -> SdpaStep | None:
        """The SDPA part of a prefill or MIXED step whose fresh requests are long enough to pay
        for running the step eager; None otherwise."""
        if mode not in SDPA_MODES:
            return None
        fresh = fresh_requests(new_lens, prefix_lens)
        if sum(n for n, f in zip(new_lens, fresh) if f) < self.min_tokens:
            return None
        return SdpaStep(self.backend, fresh)


def _backend(name: str):
    """auto: cuDNN first, then FlashAttention, then the rest (torch's own order put
    FlashAttention first, which ran below our Triton kernel on an H100: 0.52 against 0.48 ms
    at 4096 tokens, cuDNN 0.30; docs/gpu_decode.md)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    named = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
             "efficient": SDPBackend.EFFICIENT_ATTENTION}
    if name != "auto":
        return sdpa_kernel(named[name])
    order = [named["cudnn"], named["flash"], named["efficient"], SDPBackend.MATH]
    return sdpa_kernel(order, set_priority=True)


def sdpa_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int],
                 scale: float, out: torch.Tensor, backend: str = "auto",
                 only: list[bool] | None = None) -> torch.Tensor:
    """Causal attention of fresh requests' new tokens over themselves; returns the result.

    q [T, H, D], k [T, Hkv, D], v [T, Hkv, Dv], out [T, H, Dv]; request i owns the rows
    sum(lens[:i]) : sum(lens[:i + 1]). `only`: the requests to attend (default all); the rows
    of the others are left as they are. GQA is passed as such (enable_gqa), not by repeating
    K/V. The result is `out`, except where one request attended by SDPA owns every row and the
    kernel's output is already token-major (cuDNN, FlashAttention and the CPU kernels lay it
    out as q): then it is that output, unwritten into `out`, which saves a copy of the step's
    whole attention output (~1.5% of a 4096-token Qwen3 prefill; docs/gpu_decode.md)."""
    gqa = q.shape[1] != k.shape[1]
    start = 0
    with _backend(backend):
        for i, n in enumerate(lens):
            rows = slice(start, start + n)
            start += n
            if only is not None and not only[i]:
                continue
            o = F.scaled_dot_product_attention(
                q[rows].transpose(0, 1)[None], k[rows].transpose(0, 1)[None],
                v[rows].transpose(0, 1)[None], is_causal=True, scale=scale, enable_gqa=gqa)
            o = o[0].transpose(0, 1)  # [n, H, Dv]
            if n == q.shape[0] and o.is_contiguous() and o.dtype == out.dtype:
                return o
            out[rows].copy_(o)
    return out
