"""A model folder's tokenizer, loaded once per process."""

from __future__ import annotations

import functools
import json
import os
import re
from typing import Any

# the files whose change makes a cached tokenizer stale (and xgrammar's view of it: grammar_vocab)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
          "chat_template.jinja", "chat_template.json", "config.json", "tokenizer.model")


def load_tokenizer(path: str) -> Any:
    """transformers' AutoTokenizer for `path`, cached per process by the folder and its files'
    sizes and modification times: each offline Engine (a test, a benchmark, a notebook) built
    again on the same model reuses it (DeepSeek's 129k-token tokenizer takes ~0.7 s of a core to
    load). Nothing in moeserve changes a tokenizer after loading it; callers must not either."""
    real = os.path.realpath(path)
    stamps = []
    for name in TOKENIZER_FILES:
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
        tokenizer_json = os.path.join(path, "tokenizer.json")
        added = _leading_added_tokens(tokenizer_json)
        for token in added or []:
            if token.get("content") == eos:
                return int(token["id"])
        with open(tokenizer_json) as f:
            spec = json.load(f)
    except (OSError, ValueError):
        return None
    for token in spec.get("added_tokens") or []:
        if token.get("content") == eos:
            return int(token["id"])
    vocab = (spec.get("model") or {}).get("vocab")
    return int(vocab[eos]) if isinstance(vocab, dict) and eos in vocab else None


def _leading_added_tokens(path: str, first_read: int = 1 << 18) -> list | None:
    """The top-level "added_tokens" of a tokenizer.json parsed from the file's head, where the
    tokenizers library writes it (after "version", "truncation" and "padding", before the
    vocabulary): every scheduler rank reads the EOS id, and a 129k-token file (10 MB) took 0.17 s
    of a core to parse whole. None where it does not come before "model" (then parse it all)."""
    decoder = json.JSONDecoder()
    size = first_read
    with open(path, "rb") as f:
        head = b""
        while True:
            head += f.read(size - len(head))
            text = head.decode("utf-8", errors="ignore")  # only a cut last character is lost
            try:
                return _top_level_value(decoder, text, "added_tokens")
            except ValueError:
                if len(head) < size:  # the whole file: not where expected
                    return None
                size *= 4


def _top_level_value(decoder: json.JSONDecoder, text: str, key: str):
    """The value of `key` in the JSON object that `text` starts, decoding only the values before
    it; None if "model" comes first or the object has no `key`. Raises ValueError where `text`
    ends too early."""
    m = _OPEN.match(text)
    if m is None:
        raise ValueError("not an object")
    i = m.end()
    while True:
        name, i = decoder.raw_decode(text, i)
        m = _COLON.match(text, i)
        if m is None:
            raise ValueError("no ':' after a key")
        if name == "model":
            return None
        value, i = decoder.raw_decode(text, m.end())
        if name == key:
            return value
        m = _NEXT.match(text, i)
        if m is None:
            raise ValueError("the object is cut short")
        if m.group(1) == "}":
            return None
        i = m.end()


_OPEN, _COLON, _NEXT = re.compile(r"\s*\{\s*"), re.compile(r"\s*:\s*"), re.compile(r"\s*([,}])\s*")

# tokenizer classes that AutoTokenizer loads from tokenizer.json as they are
_PLAIN_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
