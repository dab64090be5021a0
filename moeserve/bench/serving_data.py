"""Prompts for the serving benchmark: random-token prompts that re-encode to the asked length."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np


@functools.lru_cache(maxsize=4)
def load_tokenizer(path: str):
    """AutoTokenizer for a local folder (cached: repeated programmatic runs reuse it)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _usable_token_ids(tokenizer) -> np.ndarray:
    """Every vocabulary id except special and added tokens."""
    excluded = set(tokenizer.all_special_ids or [])
    excluded.update(getattr(tokenizer, "added_tokens_decoder", {}).keys())
    n = len(tokenizer)
    ids = np.array([i for i in range(n) if i not in excluded], dtype=np.int64)
    if ids.size == 0:
        raise ValueError("tokenizer has no regular tokens to sample from")
    return ids


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def make_random_prompt(tokenizer, n_tokens: int, rng: np.random.Generator,
                       usable: np.ndarray, max_rounds: int = 16) -> tuple[str, int]:
    """Text that re-encodes to `n_tokens` tokens (random ids, decode, re-encode, trim/pad, repeat).

    → (prompt, its token count); the count can differ from `n_tokens` only if no round converged.
    """
    ids = rng.choice(usable, n_tokens).tolist()
    text, count = "", 0
    for _ in range(max_rounds):
        text = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        again = _encode(tokenizer, text)
        count = len(again)
        if count == n_tokens:
            break
        if count > n_tokens:
            ids = again[:n_tokens]
        else:
            ids = again + rng.choice(usable, n_tokens - count).tolist()
    return text, count


@dataclass
class BenchRequest:
    prompt: str
    prompt_len: int
    output_len: int


def _lengths(length: int, ratio: float, n: int, rng: np.random.Generator) -> list[int]:
    lo = max(1, int(length * ratio))
    hi = max(lo, length)
    return rng.integers(lo, hi + 1, size=n).tolist()


def sample_random_requests(tokenizer, num_prompts: int, input_len: int, output_len: int,
                           range_ratio: float, seed: int) -> list[BenchRequest]:
    """Random-token prompts with input/output lengths uniform in [ratio*len, len]."""
    rng = np.random.default_rng(seed)
    in_lens = _lengths(input_len, range_ratio, num_prompts, rng)
    out_lens = _lengths(output_len, range_ratio, num_prompts, rng)
    if tokenizer is None:  # no tokenizer: ~one token per random lowercase word (approximate)
        words = ["".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), 4)) for _ in range(512)]
        return [BenchRequest(" ".join(rng.choice(words, n)), n, o)
                for n, o in zip(in_lens, out_lens)]
    usable = _usable_token_ids(tokenizer)
    out = []
    for n, o in zip(in_lens, out_lens):
        prompt, count = make_random_prompt(tokenizer, n, rng, usable)
        out.append(BenchRequest(prompt, count, o))
    return out
