"""Each token's own bytes, for logprob `token`/`bytes` fields.

Decoding one token alone is wrong for tokens that hold part of a UTF-8 character (an emoji split
over byte-level tokens): the decoder yields U+FFFD, whose bytes (239, 191, 189) are not the
token's. The bytes come from the token's vocabulary entry instead:
- byte-level BPE (GPT-2, Llama 3, Qwen, DeepSeek, SmolLM2): each character of the entry stands for
  one byte through GPT-2's printable mapping of the 256 byte values;
- SentencePiece with byte fallback (Llama 2, Mistral): `<0xHH>` entries are that byte, other
  entries are text in which the decoder's replacements (`▁` → space) apply;
- added and special tokens: their text.
`text` is the bytes as UTF-8 where they decode, invalid bytes written as `\\xHH` (as DeepSeek's API
does); `bytes` lists them as they are.
"""

from __future__ import annotations

import json
import re
from typing import Any

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def printable_byte_map() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character → byte: printable Latin-1 bytes stand for
    themselves, the other 68 byte values for the code points 256, 257, … in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[chr(b)] = b
        else:
            out[chr(256 + extra)] = b
            extra += 1
    return out


class TokenBytes:
    """token id → its bytes and display text, cached; built from a transformers tokenizer."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._cache: dict[int, bytes] = {}
        self._added = {int(i): t.content for i, t in
                       getattr(tokenizer, "added_tokens_decoder", {}).items()}
        decoders = _decoder_steps(tokenizer)
        kinds = {d.get("type") for d in decoders}
        self._byte_level = printable_byte_map() if "ByteLevel" in kinds else None
        self._byte_fallback = "ByteFallback" in kinds
        self._replace = [(d["pattern"].get("String", ""), d.get("content", ""))
                         for d in decoders if d.get("type") == "Replace"
                         and isinstance(d.get("pattern"), dict)]
        self._known = self._byte_level is not None or bool(decoders)

    def bytes_of(self, token_id: int) -> bytes:
        got = self._cache.get(token_id)
        if got is None:
            got = self._cache[token_id] = self._compute(token_id)
        return got

    def text_of(self, token_id: int) -> str:
        return self.bytes_of(token_id).decode("utf-8", errors="backslashreplace")

    def _compute(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode()
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str) or not self._known:  # no vocabulary entry to read
            return self.tokenizer.decode([token_id]).encode()
        if self._byte_level is not None and all(c in self._byte_level for c in piece):
            return bytes(self._byte_level[c] for c in piece)
        m = _BYTE_PIECE.fullmatch(piece)
        if self._byte_fallback and m:
            return bytes([int(m.group(1), 16)])
        for old, new in self._replace:
            piece = piece.replace(old, new)
        return piece.encode()


def _decoder_steps(tokenizer: Any) -> list[dict[str, Any]]:
    """The fast tokenizer's decoder as a flat list of steps ({"type": ...}); [] without one."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return []
    try:  # the decoder alone (its pickled state is its JSON): to_str() writes the whole
        # vocabulary too, 0.2 s of a core for DeepSeek's 129k tokens at each server start
        step = backend.decoder
        decoder = json.loads(step.__getstate__()) if step is not None else {}
    except (AttributeError, TypeError, ValueError):
        decoder = json.loads(backend.to_str()).get("decoder") or {}
    return decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
