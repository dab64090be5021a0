"""Turn last-token logits into next tokens: greedy, temperature, top-k, top-p, min-p, seeds."""

from __future__ import annotations

import torch

from moeserve.core import SamplingParams


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """A per-request generator so a seeded request samples the same tokens in any batch."""
    if params.seed is None or params.is_greedy:
        return None
    return torch.Generator(device=device).manual_seed(params.seed)


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> torch.Tensor:
    """logits: [B, V] (any float dtype: greedy reads it as is, sampled rows in float32) → next
    token ids [B] (int64, same device)."""
    out = greedy(logits)
    for i, p in enumerate(params):
        if not p.is_greedy:
            out[i] = _sample_row(logits[i], p, generators[i])
    return out


ARGMAX_CHUNK = 2048
# bf16 logits up to this many on CPU: upcast, then one argmax (a draft head's 4096 logits: 9 µs,
# where the int16 two-stage path below costs ~115 µs in small ops; 1 x 49152: 66 against 137 µs;
# past it the upcast loses on one thread: 4 x 49152, 268 against 153 µs)
FLOAT_ARGMAX_MAX = 65_536
_BF16_INF_BITS = 0x7F80  # +inf; larger int16 bit patterns are NaNs


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim ([B, V] → [B]), the first index on ties, as torch.argmax.

    On CUDA in one launch over chunks of every row (kernels/triton/argmax.py). On CPU in two stages:
    the max of each chunk of ARGMAX_CHUNK columns (a vectorised reduction), then the argmax inside
    the first chunk holding the row's max; a single argmax over a 129k-token vocabulary ran at ~2
    GB/s (1 ms for 16 rows), the two stages in 0.14 ms. bf16 rows reduce their bit patterns as int16
    (`_greedy_bf16_bits`); few bf16 logits (FLOAT_ARGMAX_MAX) are upcast and reduced at once.
    """
    b, v = logits.shape
    if logits.device.type == "cuda":
        from moeserve.kernels.triton.argmax import argmax_rows  # Triton: CUDA machines only

        # torch's argmax reduces a row in one block: 37 µs for 129k logits on an H200
        ids = argmax_rows(logits)
        return logits.argmax(dim=-1) if ids is None else ids
    if logits.device.type != "cpu" or b == 0:
        return logits.argmax(dim=-1)
    if logits.dtype == torch.bfloat16 and b * v <= FLOAT_ARGMAX_MAX:
        return logits.float().argmax(dim=-1)  # exact: the same values, NaNs and ties
    if v <= ARGMAX_CHUNK:
        return logits.argmax(dim=-1)
    if logits.dtype == torch.bfloat16:
        return _greedy_bf16_bits(logits)
    return _two_stage_argmax(logits)


def _two_stage_argmax(x: torch.Tensor) -> torch.Tensor:
    """argmax of [B, V] (V > ARGMAX_CHUNK) through per-chunk maxima: float values, or int16 bit
    patterns (see _greedy_bf16_bits)."""
    b, v = x.shape
    c = ARGMAX_CHUNK
    m = v // c * c
    maxes = x[:, :m].view(b, m // c, c).amax(-1)  # [B, V // c]
    if m < v:
        maxes = torch.cat([maxes, x[:, m:].amax(-1, keepdim=True)], dim=1)
    best = maxes.argmax(-1)  # [B] the first chunk holding the row's max
    cols = (best[:, None] * c + torch.arange(c, device=x.device)).clamp_(max=v - 1)
    return best * c + x.gather(1, cols).argmax(-1)  # clamped repeats come after the original


def _greedy_bf16_bits(logits: torch.Tensor) -> torch.Tensor:
    """Greedy on bf16 logits through their bit patterns read as int16.

    Why: CPU reductions over bf16 convert every element (amax of 16 × 129k: 0.42 ms), int16 ones
    are plain vector code (0.05 ms). Positive bf16 values order exactly as their bits do and every
    negative value's bits are a negative int16, so a row whose max is a positive number has the same
    argmax (first index, exact equality) either way. Rows whose int16 max is not a positive finite
    value (all ≤ 0, or NaN) and rows holding any NaN (negative NaNs hide among the negative int16:
    their float sum is NaN) take the float path, so the result is torch.argmax's in every case.
    """
    bits = logits.view(torch.int16)
    out = _two_stage_argmax(bits)
    row_max = bits.gather(1, out[:, None])[:, 0]
    odd = (row_max <= 0) | (row_max > _BF16_INF_BITS) | logits.sum(-1).isnan()
    if bool(odd.any()):
        rows = odd.nonzero()[:, 0]
        out[rows] = _two_stage_argmax(logits[rows])
    return out


def _sample_row(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    return int(torch.multinomial(target_probs(logits, p), 1, generator=gen))


def target_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution a sampled request draws from: softmax(logits / T), then top-k, top-p and
    min-p (speculative verification accepts against exactly this one)."""
    probs = torch.softmax(logits.float() / p.temperature, dim=-1)  # [V]
    # NOTE: a temperature near 0 (or a repetition penalty near 0 before it) overflows logits / T
    # to inf, and softmax to NaN, which multinomial refuses: a raise that killed the scheduler.
    # The limit of softmax(x / T) as T -> 0 is the argmax's one-hot; no host sync to pick it.
    limit = torch.zeros_like(probs).scatter_(0, logits.float().argmax().view(1), 1.0)
    probs = torch.where(torch.isfinite(probs).all(), probs, limit)
    return filter_probs(probs, p.top_k, p.top_p, p.min_p)


def filter_probs(probs: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Zero out tokens outside top-k, then outside the top-p nucleus of what remains (renormalised,
    as transformers and vLLM do), then below min_p × the max prob; returns a distribution."""
    if (top_k <= 0 or top_k >= probs.numel()) and top_p >= 1.0:
        # no filter needs the order: skip the sort (129k probs: ~10-50 ms of a CPU core per
        # sampled token). The same values and the same sum as the path below, bit for bit.
        kept = probs * (probs >= min_p * probs.max()) if min_p > 0.0 else probs
        return kept / kept.sum()
    sorted_probs, order = probs.sort(descending=True)
    keep = torch.ones_like(sorted_probs, dtype=torch.bool)
    if top_k > 0:
        keep[top_k:] = False
    if top_p < 1.0:
        kept = sorted_probs * keep
        kept = kept / kept.sum()
        before = kept.cumsum(0) - kept  # mass strictly before each token
        keep &= before < top_p
    if min_p > 0.0:
        keep &= sorted_probs >= min_p * sorted_probs[0]
    keep[0] = True
    filtered = torch.zeros_like(probs).scatter_(0, order, sorted_probs * keep)
    return filtered / filtered.sum()


def logprobs_of(logits: torch.Tensor, next_ids: torch.Tensor, nums: list[int]):
    """(logprob of each chosen token, its top-n list) from raw logits [B, V]."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # [B, V]
    chosen = logp.gather(1, next_ids[:, None])[:, 0].tolist()
    k = max(max(nums), 0)
    top_v, top_i = logp.topk(k, dim=-1) if k else (None, None)
    tops = [[(int(i), float(v)) for i, v in zip(top_i[b, :n].tolist(), top_v[b, :n].tolist())]
            if k and n > 0 else [] for b, n in enumerate(nums)]
    return chosen, tops
