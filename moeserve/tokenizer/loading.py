"""A model folder's tokenizer, loaded once per process."""

from __future__ import annotations

import functools
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
