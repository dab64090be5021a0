"""A model folder's tokenizer, loaded once per process."""

from __future__ import annotations

import functools
import hashlib
import json
import os
from typing import Any

# the files whose change makes a cached tokenizer stale
_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
          "chat_template.jinja", "chat_template.json", "config.json", "tokenizer.model")


def load_tokenizer(path: str) -> Any:
    """transformers' AutoTokenizer for `path`, cached per process by the folder and its files'
    sizes and modification times: each offline Engine (a test, a benchmark, a notebook) built
    again on the same model reuses it (DeepSeek's 129k-token tokenizer takes ~0.7 s of a core to
    load). Nothing in moeserve changes a tokenizer after loading it; callers must not either."""
    real = os.path.realpath(path)
    stamps = []
    for name in _FILES:
        try:
            st = os.stat(os.path.join(real, name))
        except OSError:
            continue
        stamps.append((name, st.st_size, st.st_mtime_ns))
    return _load(real if os.path.isdir(real) else path, tuple(stamps))


@functools.lru_cache(maxsize=8)
def _load(path: str, stamps: tuple) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


class LazyTokenizer:
    """A tokenizer loaded (load_tokenizer) at its first use: a scheduler rank needs one only to
    check stop strings and to build its grammar compiler, so a rank that serves neither does not
    pay the load (DeepSeek's: ~0.8 s of a core, of ~4 s a tiny model's rank takes to start)."""

    def __init__(self, path: str):
        self.path = path
        self._tokenizer: Any = None

    def get(self) -> Any:
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.path)
        return self._tokenizer

    def __getattr__(self, name: str) -> Any:
        return getattr(self.get(), name)

    def __len__(self) -> int:
        return len(self.get())


def loaded(tokenizer: Any) -> Any:
    """The tokenizer itself, a LazyTokenizer's loaded now (for code that checks its type)."""
    return tokenizer.get() if isinstance(tokenizer, LazyTokenizer) else tokenizer


def declared_eos_id(path: str) -> int | None:
    """The id of the EOS token that tokenizer_config.json declares, read from the files without
    loading the tokenizer; None wherever the loaded tokenizer could say otherwise (another
    tokenizer class, remote code, a special_tokens_map.json, no `eos_token`, the token not found),
    so that the caller loads it instead."""
    try:
        with open(os.path.join(path, "tokenizer_config.json")) as f:
            config = json.load(f)
        if (config.get("tokenizer_class") not in _PLAIN_CLASSES or "auto_map" in config
                or os.path.exists(os.path.join(path, "special_tokens_map.json"))):
            return None
        eos = config.get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        if not isinstance(eos, str):
            return None
        with open(os.path.join(path, "tokenizer.json"), "rb") as f:
            data = f.read()
    except (OSError, ValueError):
        return None
    key = (hashlib.blake2b(data, digest_size=16).digest(), eos)
    if key not in _TOKEN_IDS:
        _TOKEN_IDS[key] = _token_id(data, eos)
    return _TOKEN_IDS[key]


# (tokenizer.json's digest, token) -> its id: each content parsed once per process. DeepSeek's
# tokenizer.json is 10 MB of JSON, ~0.2 s of a core to parse and ~10 ms to hash, which every
# offline Engine built again (and every tiny test model: they share one tokenizer) paid.
_TOKEN_IDS: dict[tuple[bytes, str], int | None] = {}


def _token_id(data: bytes, token: str) -> int | None:
    try:
        spec = json.loads(data)
    except ValueError:
        return None
    for added in spec.get("added_tokens") or []:
        if added.get("content") == token:
            return int(added["id"])
    vocab = (spec.get("model") or {}).get("vocab")
    return int(vocab[token]) if isinstance(vocab, dict) and token in vocab else None


# tokenizer classes that AutoTokenizer loads from tokenizer.json as they are
_PLAIN_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
