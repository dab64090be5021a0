"""Fresh prefill through torch's scaled_dot_product_attention (`attention.sdpa_prefill_*`).

Why: a prompt with no cached prefix reads nothing from the pool; its keys are the step's own,
contiguous rows, which is the case vendor kernels are built for. On an H100 cuDNN's kernel
attends a causal block of Qwen3's heads 1.3-1.7x faster than our Triton extend kernel, which
gathers every key through the request's slot table (docs/gpu_decode.md, "Fresh prefill through
SDPA"). So an EXTEND step whose every request starts fresh, with at least `min_tokens` new
tokens, attends with SDPA, one call per request. Prefix hits, MIXED steps (their decode riders
read cached keys), MLA (its own MHA form, mla_mha.py) and short steps keep the Triton kernel.

The per-request calls are sized by host-side lengths, so such a step runs eager, outside the
extend graphs (the runner's `fb.sdpa_prefill`): a long step's launches hide behind its device
time, and a graph replayed at another length would read the captured lengths.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moeserve.core import ForwardMode


@dataclass(frozen=True)
class SdpaPrefillPolicy:
    min_tokens: int  # attention.sdpa_prefill_min_tokens
    backend: str = "auto"  # attention.sdpa_prefill_backend (`_backend`)

    def applies(self, mode: ForwardMode, num_tokens: int, prefix_lens: list[int]) -> bool:
        """An EXTEND step of fresh requests only, long enough to pay for running eager."""
        return (mode == ForwardMode.EXTEND and num_tokens >= self.min_tokens
                and not any(prefix_lens))


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
                 scale: float, out: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """Causal attention of each fresh request's new tokens over themselves, into out.

    q [T, H, D], k [T, Hkv, D], v [T, Hkv, Dv], out [T, H, Dv]; request i owns the rows
    sum(lens[:i]) : sum(lens[:i + 1]). GQA is passed as such (enable_gqa), not by repeating
    K/V."""
    gqa = q.shape[1] != k.shape[1]
    start = 0
    with _backend(backend):
        for n in lens:
            rows = slice(start, start + n)
            start += n
            o = F.scaled_dot_product_attention(
                q[rows].transpose(0, 1)[None], k[rows].transpose(0, 1)[None],
                v[rows].transpose(0, 1)[None], is_causal=True, scale=scale, enable_gqa=gqa)
            out[rows].copy_(o[0].transpose(0, 1))
    return out
