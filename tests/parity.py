"""Helpers that compare moeserve against transformers on the same checkpoint (the oracle)."""

from __future__ import annotations

import contextlib

import torch

from moeserve.config import compose
from moeserve.core import ForwardMode
from moeserve.runtime.model_runner import ModelRunner

FP32_CPU = ["device=cpu", "model.dtype=float32"]
# For tests that feed and read token ids only (no tokenizer, no text): tiny_model(arch,
# vocab_size=ID_VOCAB). The LM head over the tokenizer's 129280 tokens is most of a tiny model's
# step (2.9 ms a token sequentially, 10 ms a step of 16, against 0.8 and 1.9 ms with 8192 rows),
# and nothing these tests compare depends on the vocabulary's size. Not a multiple of the greedy
# sampler's chunk (ARGMAX_CHUNK), so its partial last chunk runs as with the real vocabulary.
ID_VOCAB = 6000


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def make_runner(path: str, overrides: list[str] = ()) -> ModelRunner:
    return ModelRunner(compose(FP32_CPU + list(overrides)), path)


@contextlib.contextmanager
def extend_batch(runner: ModelRunner, prompts: list[list[int]], return_all_logits: bool = False):
    """One EXTEND ForwardBatch of whole prompts (no cached prefix); memory is returned after."""
    mem = runner.memory
    lens = [len(p) for p in prompts]
    rows = mem.req_to_token.alloc(len(prompts))
    slots = mem.allocator.alloc(sum(lens))
    offset = 0
    for row, n in zip(rows, lens):
        mem.req_to_token.write(row, 0, slots[offset : offset + n])
        offset += n
    try:
        yield runner.make_batch(ForwardMode.EXTEND, [t for p in prompts for t in p],
                                [i for n in lens for i in range(n)], slots, rows,
                                [0] * len(lens), lens, return_all_logits=return_all_logits)
    finally:
        mem.allocator.free(slots)
        mem.req_to_token.free(rows)


def prefill_logits(runner: ModelRunner, prompts: list[list[int]]) -> list[torch.Tensor]:
    """All-position logits of each prompt from one EXTEND batch."""
    with extend_batch(runner, prompts, return_all_logits=True) as fb:
        logits = runner.forward(fb)
    return list(logits.split([len(p) for p in prompts]))


def decode_vs_recompute(runner: ModelRunner, prompt: list[int], steps: int) -> tuple[torch.Tensor,
                                                                                     torch.Tensor]:
    """Prefill `prompt`, decode `steps` greedy tokens one by one over the paged KV; return the last
    decode logits and the logits of recomputing the whole sequence in one prefill."""
    mem = runner.memory
    (row,) = mem.req_to_token.alloc(1)
    total = len(prompt) + steps
    slots = mem.allocator.alloc(total)
    mem.req_to_token.write(row, 0, slots)
    n = len(prompt)
    fb = runner.make_batch(ForwardMode.EXTEND, prompt, list(range(n)), slots[:n], [row], [0], [n])
    seq, logits = list(prompt), runner.forward(fb)
    for pos in range(n, total):
        seq.append(int(logits[0].argmax()))
        fb = runner.make_batch(ForwardMode.DECODE, [seq[-1]], [pos], slots[pos : pos + 1], [row],
                               [pos], [1])
        logits = runner.forward(fb)
    mem.allocator.free(slots)
    mem.req_to_token.free(row)
    full = prefill_logits(runner, [seq])[0][-1]
    return logits[0], full


def hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def hf_logits(model, prompt: list[int]) -> torch.Tensor:
    return model(torch.tensor([prompt])).logits[0].float()


@torch.no_grad()
def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def prompts_of_lengths(lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, min(vocab, 30000), (n,), generator=g).tolist() for n in lengths]
