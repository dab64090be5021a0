"""A draft vocabulary: the trainer keeps the D most frequent answer tokens and the head's softmax
over them; serving gathers those LM head rows and maps the drafted index back to its token id.
Speculation stays lossless (greedy outputs equal plain decoding), and where the full head's drafts
lie inside the vocabulary the restricted head drafts exactly the same tokens."""

from __future__ import annotations

import json
import os

import pytest
import torch
from parity import FP32_CPU, ID_VOCAB, prompts_of_lengths
from safetensors.torch import load_file, save_file
from test_nextn_head import write_head

from moeserve import Engine
from moeserve.models.loader import WeightLoadError
from moeserve.spec_mtp import draft_vocab as dv

GREEDY = {"temperature": 0, "ignore_eos": True}


def _records(answers: list[list[int]], prompt_len: int = 3) -> list[dict]:
    return [{"tokens": torch.tensor([7] * prompt_len + a, dtype=torch.int32),
             "prompt_len": prompt_len} for a in answers]


def test_pick_vocab_by_answer_frequency():
    recs = _records([[5, 5, 9, 2], [9, 5, 11]])  # prompt token 7 is not counted
    vocab = dv.pick_vocab(recs, 2, 20)
    assert vocab.tolist() == [5, 9]  # counts 3 and 2
    assert dv.pick_vocab(recs, 3, 20).tolist() == [2, 5, 9]  # ties (2, 11: once) by lower id
    assert dv.pick_vocab(recs, 6, 20).tolist() == [0, 1, 2, 5, 9, 11]  # unused: lowest ids
    assert dv.coverage(recs, vocab) == pytest.approx(5 / 7)
    ids = torch.tensor([[9, 3], [5, 11]])
    assert dv.in_vocab(ids, vocab).tolist() == [[True, False], [True, False]]
    assert dv.to_draft_index(ids, vocab).tolist() == [[1, -100], [0, -100]]
    assert "| 2 (chosen) |" in dv.coverage_table(recs, recs, 20, 2)


def _add_vocab(head_dir: str, vocab: list[int]) -> None:
    """Write `vocab` into a head file as the trainer does (tensor + config key)."""
    file = os.path.join(head_dir, "model.safetensors")
    tensors = load_file(file)
    tensors["draft_vocab"] = torch.tensor(sorted(vocab), dtype=torch.int64)
    save_file(tensors, file)
    cfg_file = os.path.join(head_dir, "config.json")
    with open(cfg_file) as f:
        cfg = json.load(f)
    with open(cfg_file, "w") as f:
        json.dump(cfg | {"draft_vocab_size": len(vocab)}, f)


def _serve(model_dir: str, head_dir: str, prompts, params):
    """(outputs, every drafted token in order, accepted counts) with a recording draft."""
    with Engine(model_dir, FP32_CPU + ["spec.algorithm=nextn", "spec.max_batch_size=0",
        "spec.num_steps=3",
                                       f"spec.draft_path={head_dir}"]) as eng:
        draft, drafted = eng.runner.draft, []
        real = draft.tokens

        def tokens(logits):
            out = real(logits)
            drafted.extend(out.tolist())
            return out

        draft.tokens = tokens
        outs = eng.generate(input_ids=prompts, sampling_params=params)
        assert eng.scheduler.is_memory_clean()
        metas = [o["meta"] for o in outs]
        return ([o["output_ids"] for o in outs], drafted,
                [m.get("spec_accepted_tokens") for m in metas], draft)


def test_serving_with_vocab_equals_plain_and_full_head(tiny_model, tmp_path):
    """The full head's drafted tokens plus random others as the vocabulary: the restricted head
    drafts the same tokens (so the index → id map is right), accepts the same counts, and every
    output equals plain decoding; a vocabulary missing them still gives the plain outputs."""
    model_dir = tiny_model("llama", vocab_size=ID_VOCAB)
    prompts = prompts_of_lengths([5, 17, 9, 30], 1000, seed=1)
    params = [{**GREEDY, "max_new_tokens": n} for n in (12, 3, 20, 7)]
    with Engine(model_dir, FP32_CPU) as eng:
        want = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=params)]
    full_dir = write_head(str(tmp_path / "full"), model_dir, seed=2)
    outs, drafted, accepted, draft = _serve(model_dir, full_dir, prompts, params)
    assert outs == want and draft.vocab is None
    vocab_size = draft.target.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    extra = torch.randperm(vocab_size, generator=gen)[:40].tolist()
    vocab = sorted(set(drafted) | set(extra))
    assert len(vocab) < vocab_size // 2

    in_dir = write_head(str(tmp_path / "in"), model_dir, seed=2)
    _add_vocab(in_dir, vocab)
    outs2, drafted2, accepted2, draft2 = _serve(model_dir, in_dir, prompts, params)
    assert draft2.vocab.tolist() == vocab and draft2.lm_head.weight.shape[0] == len(vocab)
    assert outs2 == want and drafted2 == drafted and accepted2 == accepted

    out_dir = write_head(str(tmp_path / "out"), model_dir, seed=2)
    _add_vocab(out_dir, [t for t in range(vocab_size) if t not in set(drafted)][:64])
    outs3, drafted3, _, _ = _serve(model_dir, out_dir, prompts, params)
    assert outs3 == want and not set(drafted3) & set(drafted)


def test_vocab_logits_are_the_full_heads_rows(tiny_model, tmp_path):
    model_dir = tiny_model("llama")
    head_dir = write_head(str(tmp_path / "head"), model_dir)
    vocab = [3, 10, 11, 500]
    _add_vocab(head_dir, vocab)
    with Engine(model_dir, FP32_CPU + ["spec.algorithm=nextn", "spec.max_batch_size=0",
                                       f"spec.draft_path={head_dir}"]) as eng:
        draft = eng.runner.draft
        hidden = torch.randn(5, draft.target.config.hidden_size)
        with torch.inference_mode():
            full = draft.target.compute_logits(hidden)
            ours = draft.logits(hidden)
            torch.testing.assert_close(ours, full[:, vocab], rtol=1e-5, atol=1e-6)  # blocking
            assert draft.tokens(ours).tolist() == [vocab[i] for i in ours.argmax(-1).tolist()]


@pytest.mark.parametrize("vocab", [[4, 3], [1, 1], [-1, 2], [2, 10 ** 9]])
def test_bad_vocab_is_refused(tiny_model, tmp_path, vocab):
    model_dir = tiny_model("llama")
    head_dir = write_head(str(tmp_path / "head"), model_dir)
    file = os.path.join(head_dir, "model.safetensors")
    tensors = load_file(file) | {"draft_vocab": torch.tensor(vocab, dtype=torch.int64)}
    save_file(tensors, file)
    with pytest.raises(WeightLoadError, match="draft_vocab"):
        Engine(model_dir, FP32_CPU + ["spec.algorithm=nextn", f"spec.draft_path={head_dir}"])


def test_bf16_verify_through_the_greedy_head(tiny_model, tmp_path):
    """In bf16 on a CPU with the fused greedy LM head, greedy verify passes take the argmax from
    it (no logits), as plain greedy steps do, and the outputs equal plain decoding."""
    model_dir = tiny_model("llama")
    head_dir = write_head(str(tmp_path / "head"), model_dir)
    _add_vocab(head_dir, list(range(0, 1000, 3)))
    bf16 = ["device=cpu", "model.dtype=bfloat16"]
    prompts = prompts_of_lengths([5, 17, 9], 1000, seed=4)
    params = [{**GREEDY, "max_new_tokens": n} for n in (14, 6, 20)]
    with Engine(model_dir, bf16) as eng:
        if eng.runner.greedy_head is None:
            pytest.skip("no fused greedy LM head on this CPU")
        want = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=params)]
    with Engine(model_dir, bf16 + ["spec.algorithm=nextn", "spec.max_batch_size=0",
        "spec.num_steps=3",
                                   f"spec.draft_path={head_dir}"]) as eng:
        spec, without_logits = eng.scheduler.worker.spec, []
        real = spec._verify_forward

        def spy(fi, fb, vmask):
            out = real(fi, fb, vmask)
            without_logits.append(out[0] is None)
            return out

        spec._verify_forward = spy
        outs = eng.generate(input_ids=prompts, sampling_params=params)
        assert [o["output_ids"] for o in outs] == want
        assert without_logits and all(without_logits)
        assert eng.scheduler.is_memory_clean()


def test_vocab_rows_of_an_fp8_lm_head_are_its_dequantized_rows(tiny_model, tmp_path):
    """model.fp8_lm_head with a draft vocabulary: the head gathers the FP8 LM head's rows as
    they act (dequantized), not its e4m3 bytes."""
    from parity import make_runner

    from moeserve.layers.fp8_linear import Fp8Linear

    model_dir = tiny_model("llama")
    head_dir = write_head(str(tmp_path / "head"), model_dir)
    vocab = [3, 17, 40, 41, 200]
    _add_vocab(head_dir, vocab)
    runner = make_runner(model_dir, ["model.quantization=fp8", "model.fp8_lm_head=true",
                                     "spec.algorithm=nextn", f"spec.draft_path={head_dir}"])
    assert isinstance(runner.model.lm_head, Fp8Linear)
    want = runner.model.lm_head.dequantized()[torch.tensor(vocab)]
    assert torch.equal(runner.draft.lm_head.weight, want.to(runner.draft.lm_head.weight.dtype))
