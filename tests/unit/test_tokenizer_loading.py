"""tokenizer/loading.py: the EOS id read from the files is transformers' own, anything it cannot
vouch for is None; a LazyTokenizer loads at its first use; the per-process cache is keyed by the
files, so a changed tokenizer is loaded again."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from transformers import AutoTokenizer

from moeserve.models.embedded import embedded_model_path
from moeserve.tokenizer.loading import LazyTokenizer, declared_eos_id, load_tokenizer, loaded


@pytest.mark.parametrize("arch", [None, "llama"])  # every tiny arch has make_tiny's tokenizer
def test_declared_eos_is_what_transformers_loads(tiny_model, arch):
    path = embedded_model_path() if arch is None else tiny_model(arch)
    assert declared_eos_id(path) == AutoTokenizer.from_pretrained(path).eos_token_id


def test_added_tokens_read_from_the_head_equal_the_whole_parse(tiny_model, tmp_path):
    from moeserve.tokenizer.loading import _leading_added_tokens

    for path in (embedded_model_path(), tiny_model("llama")):
        name = os.path.join(path, "tokenizer.json")
        with open(name) as f:
            whole = json.load(f)
        for first_read in (64, 1 << 18):  # the head read grows until the list is whole
            assert _leading_added_tokens(name, first_read) == whole["added_tokens"]
    # a file that puts the vocabulary first is parsed whole: the same EOS id
    src = tiny_model("llama")
    shutil.copy(os.path.join(src, "tokenizer_config.json"), tmp_path / "tokenizer_config.json")
    reordered = {"model": whole["model"], **{k: v for k, v in whole.items() if k != "model"}}
    (tmp_path / "tokenizer.json").write_text(json.dumps(reordered))
    assert _leading_added_tokens(str(tmp_path / "tokenizer.json")) is None
    assert declared_eos_id(str(tmp_path)) == declared_eos_id(src) is not None


def test_declared_eos_declines_what_it_cannot_vouch_for(tiny_model, tmp_path):
    src = tiny_model("llama")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(src, name), tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert declared_eos_id(str(tmp_path)) is not None
    (tmp_path / "special_tokens_map.json").write_text("{}")  # may override the config's tokens
    assert declared_eos_id(str(tmp_path)) is None
    os.unlink(tmp_path / "special_tokens_map.json")
    for change in ({"tokenizer_class": "LlamaTokenizer"}, {"eos_token": None},
                   {"eos_token": "<not a token>"}, {"auto_map": {"AutoTokenizer": ["x.Y", None]}}):
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, **change}))
        assert declared_eos_id(str(tmp_path)) is None, change
    assert declared_eos_id(str(tmp_path / "missing")) is None


def test_lazy_tokenizer_loads_at_first_use_and_cache_follows_the_files(tiny_model, tmp_path):
    src = tiny_model("llama")
    for name in os.listdir(src):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(src, name), tmp_path / name)
    lazy = LazyTokenizer(str(tmp_path))
    assert lazy._tokenizer is None
    assert lazy.decode([100, 200]) == AutoTokenizer.from_pretrained(src).decode([100, 200])
    assert loaded(lazy) is lazy.get() is load_tokenizer(str(tmp_path))  # one load per process
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 7}))
    again = load_tokenizer(str(tmp_path))
    assert again is not lazy.get() and again.model_max_length == 7

