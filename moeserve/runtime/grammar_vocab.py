"""xgrammar's view of a tokenizer's vocabulary (TokenizerInfo), cached on disk.

Why: every process that serves structured outputs builds one (each scheduler rank, and the server
process for its 400s). From the transformers tokenizer that takes loading the tokenizer (DeepSeek's
129k tokens: ~0.7 s of a core) and xgrammar's build (~0.5 s); read back from xgrammar's own
serialization it takes ~0.1 s and no tokenizer. The cache is keyed by the bytes of the tokenizer's
files, the vocabulary size and xgrammar's version, so a changed tokenizer or xgrammar misses it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from collections.abc import Callable
from importlib.metadata import version
from typing import Any

from moeserve.tokenizer.loading import TOKENIZER_FILES

logger = logging.getLogger(__name__)


def tokenizer_info(folder: str | None, vocab_size: int, tokenizer: Callable[[], Any],
                   cache_dir: str) -> Any:
    """The TokenizerInfo of the tokenizer in `folder` (None: not a folder, no cache), read from
    `cache_dir` or built from `tokenizer()` (the loaded transformers tokenizer) and saved there."""
    import xgrammar as xgr

    path = _cache_path(folder, vocab_size, cache_dir) if folder else None
    if path is not None:
        try:
            with open(path) as f:
                return xgr.TokenizerInfo.deserialize_json(f.read())
        except OSError:
            pass  # not cached yet
        except Exception as e:  # noqa: BLE001 - a corrupt entry is rebuilt
            logger.warning("cached tokenizer info %s unreadable (%s): rebuilding it", path, e)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer(), vocab_size=vocab_size)
    if path is not None:
        _save(path, info.serialize_json())
    return info


def _cache_path(folder: str, vocab_size: int, cache_dir: str) -> str | None:
    digest = hashlib.sha256(f"xgrammar {version('xgrammar')} vocab {vocab_size}".encode())
    found = False
    for name in TOKENIZER_FILES:
        try:
            with open(os.path.join(folder, name), "rb") as f:
                data = f.read()
        except OSError:
            continue
        found = True
        digest.update(f"{name} {len(data)}\n".encode())
        digest.update(data)
    if not found:
        return None
    return os.path.join(cache_dir, "xgrammar", f"tokenizer-info-{digest.hexdigest()[:32]}.json")


def _save(path: str, text: str) -> None:
    tmp = None
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".json", dir=os.path.dirname(path))
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)  # atomic: concurrent ranks never read half a file
    except OSError as e:  # a read-only or full cache: build again next time
        logger.info("tokenizer info not cached (%s)", e)
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
