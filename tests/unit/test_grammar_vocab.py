"""runtime/grammar_vocab.py: xgrammar's TokenizerInfo read back from the disk cache is the one built
from the tokenizer (same serialization, same token masks), without loading the tokenizer; a changed
tokenizer file misses the cache and a corrupt entry is rebuilt."""

from __future__ import annotations

import json
import os
import shutil

import pytest

xgr = pytest.importorskip("xgrammar")

from moeserve.models.embedded import embedded_model_path  # noqa: E402
from moeserve.runtime.grammar_vocab import tokenizer_info  # noqa: E402
from moeserve.tokenizer.loading import TOKENIZER_FILES, load_tokenizer  # noqa: E402


def first_mask(info) -> list[int]:
    compiled = xgr.GrammarCompiler(info).compile_regex("(yes|no), [a-z]{2,8}")
    matcher = xgr.GrammarMatcher(compiled)
    bits = xgr.allocate_token_bitmask(1, info.vocab_size)
    matcher.fill_next_token_bitmask(bits)
    return bits[0].tolist()


def test_cached_info_equals_the_built_one_and_needs_no_tokenizer(tmp_path):
    folder = tmp_path / "tok"
    folder.mkdir()
    for name in TOKENIZER_FILES:
        if os.path.exists(os.path.join(embedded_model_path(), name)):
            shutil.copy(os.path.join(embedded_model_path(), name), folder / name)
    loads = []

    def tokenizer():
        loads.append(1)
        return load_tokenizer(str(folder))

    cache = str(tmp_path / "cache")
    vocab = len(load_tokenizer(str(folder)))
    built = tokenizer_info(str(folder), vocab, tokenizer, cache)
    assert len(loads) == 1 and len(os.listdir(os.path.join(cache, "xgrammar"))) == 1
    cached = tokenizer_info(str(folder), vocab, tokenizer, cache)
    assert len(loads) == 1  # read back: the tokenizer was not needed
    assert cached.serialize_json() == built.serialize_json()
    assert first_mask(cached) == first_mask(built) == first_mask(
        xgr.TokenizerInfo.from_huggingface(load_tokenizer(str(folder)), vocab_size=vocab))
    # another vocabulary size or a changed tokenizer file: another entry
    tokenizer_info(str(folder), vocab + 64, tokenizer, cache)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 7}))
    tokenizer_info(str(folder), vocab, tokenizer, cache)
    assert len(loads) == 3 and len(os.listdir(os.path.join(cache, "xgrammar"))) == 3
    # a corrupt entry is rebuilt and rewritten
    for name in os.listdir(os.path.join(cache, "xgrammar")):
        with open(os.path.join(cache, "xgrammar", name), "w") as f:
            f.write("{not json")
    again = tokenizer_info(str(folder), vocab, tokenizer, cache)
    assert len(loads) == 4 and again.serialize_json() == tokenizer_info(
        str(folder), vocab, tokenizer, cache).serialize_json()
    assert len(loads) == 4
    # no folder (a tokenizer object without files): built, nothing cached
    tokenizer_info(None, vocab, tokenizer, str(tmp_path / "unused"))
    assert len(loads) == 5 and not os.path.exists(tmp_path / "unused")
