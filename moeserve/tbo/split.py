"""Split one ForwardBatch into two micro-batches for two-batch overlap.

Rule: micro-batch A takes the first ceil(T/2) tokens, B the other floor(T/2), in batch order. A
decode batch (one token per request) is thereby split by sequences, into halves of equal tokens.
An extend batch is cut at a request boundary when one lies exactly at ceil(T/2); otherwise inside
the request that straddles it (its first tokens go to A, the rest to B as an extend over the longer
prefix).

Why always exactly half the tokens, even at the price of cutting a request:
- the MoE layers' compute and dispatch/combine volume grow with tokens, so equal token counts make
  each micro-batch's compute about as long as the other's communication it must hide;
- every rank's micro-batch sizes then follow from its step token count alone, which every rank
  already has from the DP sync (`global_num_tokens`): the dispatchers that need each rank's count
  (allgather's padding, p2p's layout, DeepEP's sizing) get it exactly, with no extra collective.
Cutting a request is correct because A's ops of a layer run before B's ops of the same layer (see
tbo/operations.py), so B's half attends over the KV that A's half has just written. The price:
B's half of a cut prompt attends over a longer prefix than A's (attention is not token-balanced);
for MoE models the routed experts dominate.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from moeserve.core import ForwardMode
from moeserve.forward_batch import ForwardBatch


def micro_token_counts(num_tokens: int) -> tuple[int, int]:
    """Tokens of micro-batches A and B for a step of `num_tokens` (any rank, any mode)."""
    return (num_tokens + 1) // 2, num_tokens // 2


@dataclass(frozen=True)
class SplitPlan:
    """A holds requests [0, a_end), B holds [b_start, B); when a request is cut (cut > 0) it is
    request a_end - 1 == b_start, its first `cut` new tokens in A."""

    tokens_a: int
    a_end: int
    b_start: int
    cut: int = 0


def plan_split(extend_lens: list[int]) -> SplitPlan:
    """Where to cut a batch whose requests bring `extend_lens` new tokens each."""
    target = micro_token_counts(sum(extend_lens))[0]
    before = 0
    for i, n in enumerate(extend_lens):
        if before + n >= target:
            if before + n == target:
                return SplitPlan(target, i + 1, i + 1)
            return SplitPlan(target, i + 1, i, cut=target - before)
        before += n
    return SplitPlan(0, 0, 0)  # no tokens: both halves empty


def split_batch(fb: ForwardBatch) -> tuple[ForwardBatch, ForwardBatch]:
    """fb → (A, B), each a ForwardBatch of its own (own attention metadata, own token counts for
    the dispatchers); an empty half is IDLE and still joins every collective."""
    plan = plan_split(fb.extend_seq_lens_cpu)
    counts = [micro_token_counts(n) for n in fb.global_num_tokens or []]
    t = fb.num_tokens
    prefix, ext = fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu
    a_ext = ext[: plan.a_end]
    if plan.cut:
        a_ext = a_ext[:-1] + [plan.cut]
    a_prefix = prefix[: plan.a_end]
    b_prefix, b_ext = list(prefix[plan.b_start :]), list(ext[plan.b_start :])
    if plan.cut:
        b_prefix[0] += plan.cut
        b_ext[0] -= plan.cut
    a = _part(fb, 0, plan.tokens_a, 0, plan.a_end, a_prefix, a_ext,
              [c[0] for c in counts] or None)
    b = _part(fb, plan.tokens_a, t, plan.b_start, fb.batch_size, b_prefix, b_ext,
              [c[1] for c in counts] or None)
    return a, b


def _part(fb: ForwardBatch, t0: int, t1: int, r0: int, r1: int, prefix: list[int],
          ext: list[int], global_num_tokens: list[int] | None) -> ForwardBatch:
    """Tokens [t0, t1) and requests [r0, r1) of fb, with the given per-request lengths."""
    seq_cpu = [p + n for p, n in zip(prefix, ext)]
    seq = fb.seq_lens[r0:r1]
    if seq_cpu != fb.seq_lens_cpu[r0:r1]:  # A's cut request ends early
        seq = torch.tensor(seq_cpu, dtype=fb.seq_lens.dtype, device=fb.seq_lens.device)
    return dataclasses.replace(
        fb, forward_mode=fb.forward_mode if t1 > t0 else ForwardMode.IDLE,
        input_ids=fb.input_ids[t0:t1], positions=fb.positions[t0:t1],
        out_cache_loc=fb.out_cache_loc[t0:t1], req_pool_indices=fb.req_pool_indices[r0:r1],
        seq_lens=seq, seq_lens_cpu=seq_cpu, extend_prefix_lens_cpu=list(prefix),
        extend_seq_lens_cpu=list(ext), return_all_logits=False,
        global_num_tokens=global_num_tokens, attn_metadata=None, tbo=False, micro_batch=True,
        shared_prefix=None)
