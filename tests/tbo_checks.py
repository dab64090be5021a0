"""Checks shared by the CPU and GPU two-batch-overlap tests: greedy decoding with chosen steps
split, and a forced TBO forward (one rank) against the plain one."""

from __future__ import annotations

import dataclasses

import torch
from parity import extend_batch, prompts_of_lengths

from moeserve.core import ForwardMode
from moeserve.ep.loopback import LoopbackDispatcher
from moeserve.runtime.moe_setup import num_logical_experts


def greedy_decode(runner, prompts, steps, tbo_at):
    """Prefill then `steps` batched decode steps; step i runs as TBO when tbo_at(i)."""
    mem = runner.memory
    rows = mem.req_to_token.alloc(len(prompts))
    slots = [mem.allocator.alloc(len(p) + steps) for p in prompts]
    for row, s in zip(rows, slots):
        mem.req_to_token.write(row, 0, s)
    lens = [len(p) for p in prompts]
    fb = runner.make_batch(ForwardMode.EXTEND, [t for p in prompts for t in p],
                           [i for n in lens for i in range(n)],
                           torch.cat([s[:n] for s, n in zip(slots, lens)]), rows, [0] * len(lens),
                           lens)
    seqs, out = [list(p) for p in prompts], []
    logits = runner.forward(fb)
    for i in range(steps):
        nxt = logits.argmax(-1).tolist()
        out.append(nxt)
        pos = [len(s) for s in seqs]
        for s, t in zip(seqs, nxt):
            s.append(t)
        fb = runner.make_batch(ForwardMode.DECODE, nxt, pos,
                               torch.stack([s[p] for s, p in zip(slots, pos)]), rows, pos,
                               [1] * len(pos), tbo=tbo_at(i))
        logits = runner.forward(fb)
    for s in slots:
        mem.allocator.free(s)
    mem.req_to_token.free(rows)
    return out


def check_forced_tbo_with_loopback(runner, tol: float = 1e-4) -> None:
    """With a loopback dispatcher (micro-batch copies on the side stream on CUDA): a TBO prefill
    that cuts a request in two gives the plain logits, and TBO decode steps the plain tokens."""
    cfg = runner.hf_config
    runner.moe_parallel.dispatcher = LoopbackDispatcher(
        runner.mesh, runner.moe_parallel.num_physical(num_logical_experts(cfg)),
        cfg.hidden_size, runner.dtype)
    prompts = prompts_of_lengths([4, 9, 3], cfg.vocab_size, seed=4)
    with extend_batch(runner, prompts, return_all_logits=True) as fb:  # cuts request 1
        ref = runner.forward(fb)
        ours = runner.forward(dataclasses.replace(fb, tbo=True, attn_metadata=None))
    torch.testing.assert_close(ours, ref, rtol=tol, atol=tol)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    ref_ids = greedy_decode(runner, prompts, 2, lambda i: False)
    assert greedy_decode(runner, prompts, 2, lambda i: True) == ref_ids
