"""Test hooks on MoE routing: a known expert popularity (EPLB measurements), or uniform random
experts (benchmarks on dummy weights).

With MOESERVE_TEST_ZIPF_ROUTER=S (S > 0; tests and benchmarks only, off by default) every MoE
block adds a fixed logit bias to its router logits before top-k:

    bias[perm[i]] = -S * ln(i + 1)      i = 0 .. E-1, perm a permutation of the experts per layer

i.e. bias = ln p + const for the Zipf(S) popularity p_i ∝ 1 / (i + 1)^S, with expert perm[0] the
most popular. The permutation is drawn from a generator seeded by the layer index, so every rank
builds the same bias and layers differ in their hot experts (as in real traces). The bias shifts
the choice, not the shape of the router: the realised load follows the Zipf order, and how steep it
is also depends on the spread of the logits (measure it: the recorder's dump, `moeserve.eplb
report`). Off (unset or 0), no bias tensor exists and routing is untouched.

With MOESERVE_TEST_RANDOM_ROUTER=1 every MoE block replaces its router logits by a random
permutation of evenly spaced values per token (the ranks of i.i.d. uniform draws), so each token's
top-k are K distinct experts drawn uniformly, and its routing weights come from those logits too.
Dummy weights route most tokens of deep layers to the same few experts
(a 4096-token prefill of dummy Qwen3-30B-A3B used 27-29 of 128 experts from layer 24 on,
docs/gpu_decode.md), which makes the grouped GEMMs denser than a real checkpoint's; this hook
gives benchmarks the balanced load instead. It takes precedence over the Zipf hook.
"""

from __future__ import annotations

import math

import torch

from moeserve.env import env


def zipf_logit_bias(num_experts: int, exponent: float, layer_id: int) -> torch.Tensor:
    """[E] float32: -exponent * ln(popularity rank), experts shuffled by a layer-seeded draw."""
    gen = torch.Generator().manual_seed(layer_id)
    perm = torch.randperm(num_experts, generator=gen)  # perm[i]: the i-th most popular expert
    ranks = torch.arange(1, num_experts + 1, dtype=torch.float64)
    bias = torch.empty(num_experts, dtype=torch.float64)
    bias[perm] = -exponent * ranks.log()
    return bias.float()


def zipf_popularity(num_experts: int, exponent: float, layer_id: int) -> torch.Tensor:
    """[E] float64, sums to 1: the Zipf(exponent) popularity that zipf_logit_bias encodes."""
    p = zipf_logit_bias(num_experts, exponent, layer_id).double().exp()
    return p / p.sum()


class RandomLogits:
    """The random-router hook's stand-in for a bias: `skewed` draws fresh logits each call."""

    def __repr__(self) -> str:
        return "RandomLogits()"


def routing_skew(num_experts: int, layer_id: int, device: torch.device
                 ) -> torch.Tensor | RandomLogits | None:
    """What a MoE block does to its router logits: add this bias, draw them (RandomLogits), or
    nothing (None: both hooks off)."""
    if env().test_random_router:
        return RandomLogits()
    exponent = env().test_zipf_router
    if exponent == 0.0:
        return None
    if not math.isfinite(exponent) or exponent < 0:
        raise ValueError(f"MOESERVE_TEST_ZIPF_ROUTER={exponent}: expected a Zipf exponent >= 0")
    return zipf_logit_bias(num_experts, exponent, layer_id).to(device)


def routing_hook_name() -> str:
    """Which routing the MoE blocks built now would run, for benchmark headers: the router's own
    ("router"), or a hook's."""
    if env().test_random_router:
        return "uniform random (MOESERVE_TEST_RANDOM_ROUTER)"
    exponent = env().test_zipf_router
    return "router" if exponent == 0.0 else f"zipf {exponent:g} bias (MOESERVE_TEST_ZIPF_ROUTER)"


def skewed(logits: torch.Tensor, bias: torch.Tensor | RandomLogits | None) -> torch.Tensor:
    """logits [T, E] + bias (in the logits' dtype); for RandomLogits a random permutation of
    0, 1/E, .., (E-1)/E per token (distinct, exact in bf16 up to 256 experts: no ties for top-k
    to break by index); unchanged when bias is None."""
    if bias is None:
        return logits
    if isinstance(bias, RandomLogits):
        ranks = torch.rand(logits.shape, device=logits.device).argsort(dim=-1)
        return ranks.to(logits.dtype) / logits.shape[-1]
    return logits + bias.to(logits.dtype)
