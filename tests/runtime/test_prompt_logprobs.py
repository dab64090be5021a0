"""Prompt logprobs through the real Scheduler (the offline Engine) against transformers' logits on
the same checkpoint: chunked prefill, prefix-cache hits before and after the first asked position,
the overlap loop with decodes riding along (MIXED steps), retraction under KV pressure,
max_new_tokens=0, top alternatives; and the block-wise scoring against one whole log_softmax."""

from __future__ import annotations

import random

import pytest
import torch
from parity import FP32_CPU

from moeserve import Engine
from moeserve.runtime import prompt_logprobs
from moeserve.runtime.prompt_logprobs import PromptSpan, score_spans

GREEDY = {"temperature": 0, "ignore_eos": True}
TOL = 1e-4


def workload(seed: int = 0) -> list[list[int]]:
    """Prompts sharing a 20-token prefix (cache hits), 5 to 45 tokens."""
    rng = random.Random(seed)
    shared = [rng.randrange(100, 5000) for _ in range(20)]
    return [shared + [rng.randrange(100, 5000) for _ in range(n)] for n in (25, 3, 11, 0)] + [
        [rng.randrange(100, 5000) for _ in range(5)]]


@pytest.fixture(scope="module", autouse=True)
def one_forward_thread():
    """A tiny model's forward in one thread, as the server runs it (scheduler.cpu_threads): two
    threads on a busy 2-core machine wait for each other at every op (the normal loop's run here
    went from ~2 s to ~40 s)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def reference(tiny_model):
    """(checkpoint, prompts, per prompt transformers' log-probs at every position [L, V])."""
    from transformers import AutoModelForCausalLM

    path = tiny_model("llama")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = workload()
    with torch.no_grad():
        logps = [torch.log_softmax(model(torch.tensor([p])).logits[0].float(), -1)
                 for p in prompts]
    return path, prompts, logps


def expected(prompt: list[int], logp: torch.Tensor, start: int) -> list[float | None]:
    return [None if i == 0 else logp[i - 1, prompt[i]].item() for i in range(start, len(prompt))]


def assert_close(got: list, want: list) -> None:
    assert len(got) == len(want)
    assert [g is None for g in got] == [w is None for w in want]
    diff = max((abs(g - w) for g, w in zip(got, want) if w is not None), default=0.0)
    assert diff < TOL, diff


@pytest.mark.parametrize("overrides", [
    ["scheduler.overlap=false", "scheduler.chunked_prefill_size=8", "cache.page_size=4"],
    ["scheduler.overlap=true", "scheduler.mixed_chunk=true", "scheduler.chunked_prefill_size=16"],
], ids=["normal-chunk8-page4", "overlap-mixed-chunk16"])
def test_prompt_logprobs_equal_transformers(reference, overrides):
    path, prompts, logps = reference
    with Engine(path, FP32_CPU + overrides) as eng:
        eng.generate(input_ids=[prompts[0]], sampling_params={**GREEDY, "max_new_tokens": 1})
        # scored prompts beside plain requests that keep decoding (MIXED steps on the overlap run)
        plain = eng.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 3})
        mixed = [{**GREEDY, "max_new_tokens": 3}] * len(prompts) + [
            {**GREEDY, "max_new_tokens": 20}] * 3
        outs = eng.generate(input_ids=prompts + prompts[:3], sampling_params=mixed,
                            logprob_start_len=0, top_logprobs_num=3)
        for prompt, logp, out, base in zip(prompts, logps, outs, plain):
            meta = out["meta"]
            assert_close(meta["input_logprobs"], expected(prompt, logp, 0))
            assert meta["cached_tokens"] == 0  # a hit would have skipped asked positions
            assert out["output_ids"] == base["output_ids"]  # sampling is unchanged
            tops = meta["input_top_logprobs"]
            assert tops[0] is None
            for i in range(1, len(prompt)):
                want = logp[i - 1].topk(3)
                assert [t for t, _ in tops[i]] == want.indices.tolist()
                assert max(abs(v - w) for (_, v), w in zip(tops[i], want.values.tolist())) < TOL
        start = 12  # positions before 11 may come from the cache; from 11 on they are computed
        late = eng.generate(input_ids=prompts[:3], sampling_params={**GREEDY, "max_new_tokens": 2},
                            logprob_start_len=start)
        for prompt, logp, out in zip(prompts, logps, late):
            assert_close(out["meta"]["input_logprobs"], expected(prompt, logp, start))
            assert 0 < out["meta"]["cached_tokens"] <= start - 1
        assert eng.scheduler.is_memory_clean()


def test_max_new_tokens_zero_scores_without_generating(reference):
    path, prompts, logps = reference
    with Engine(path, FP32_CPU) as eng:
        outs = eng.generate(input_ids=prompts, sampling_params={"max_new_tokens": 0},
                            logprob_start_len=0)
        for prompt, logp, out in zip(prompts, logps, outs):
            assert out["output_ids"] == [] and out["meta"]["finish_reason"] == "length"
            assert out["meta"]["completion_tokens"] == 0
            assert_close(out["meta"]["input_logprobs"], expected(prompt, logp, 0))
        one = eng.generate(input_ids=[[7]], sampling_params={"max_new_tokens": 0},
                           logprob_start_len=0)[0]
        assert one["meta"]["input_logprobs"] == [None]  # position 0 has no context
        assert eng.scheduler.is_memory_clean()


@pytest.mark.parametrize("overlap", [False, True])
def test_prompt_logprobs_survive_retraction(reference, overlap):
    """A pool that holds a fraction of the requests: scored requests are retracted and prefilled
    again, yet each prompt logprob is reported once and equals transformers'."""
    path, prompts, logps = reference
    small = FP32_CPU + [f"scheduler.overlap={str(overlap).lower()}", "cache.max_total_tokens=160",
                        "scheduler.init_new_token_ratio=0.05", "scheduler.min_new_token_ratio=0.01"]
    with Engine(path, small) as eng:
        outs = eng.generate(input_ids=prompts * 4, sampling_params={**GREEDY, "max_new_tokens": 16},
                            logprob_start_len=0)
        assert eng.scheduler.stats["retractions"] > 0
        for k, out in enumerate(outs):
            i = k % len(prompts)
            assert_close(out["meta"]["input_logprobs"], expected(prompts[i], logps[i], 0))
        assert eng.scheduler.is_memory_clean()


def test_scoring_runs_the_head_in_blocks(monkeypatch):
    """score_spans equals one log_softmax over the whole [rows, V] logits, while the LM head never
    sees more than SCORE_LOGITS logits' worth of rows at once."""
    torch.manual_seed(0)
    vocab, hidden = 50, 8
    head = torch.randn(vocab, hidden)
    states = torch.randn(30, hidden)  # [T, H]
    seen: list[int] = []

    def lm_head(h: torch.Tensor) -> torch.Tensor:
        seen.append(h.shape[0])
        return h @ head.T

    monkeypatch.setattr(prompt_logprobs, "SCORE_LOGITS", 4 * vocab)
    spans = [PromptSpan(0, 2, 3, [5, 9, 1, 0, 7, 7, 3], 2), PromptSpan(2, 20, 1, [4] * 9, 0)]
    got = score_spans(lm_head, states, spans)
    assert max(seen) <= 4 and sum(seen) == 16
    full = torch.log_softmax(states @ head.T, -1)
    for span, scores in zip(spans, got):
        rows = range(span.row, span.row + len(span.targets))
        want = [full[r, t].item() for r, t in zip(rows, span.targets)]
        assert max(abs(a - b) for a, b in zip(scores.values, want)) < 1e-5
        assert scores.ranks == [int((full[r] > full[r, t]).sum()) + 1
                                for r, t in zip(rows, span.targets)]
        assert scores.first == span.first
        if span.top:
            assert [[i for i, _ in row] for row in scores.tops] == [
                full[r].topk(span.top).indices.tolist() for r in rows]
        else:
            assert scores.tops is None


def test_prompt_logprobs_while_speculating(tiny_model):
    """With MTP speculation (tiny DeepSeek-V3's own MTP layer) the target's prefill steps run in
    the speculative decoder, which scores them too: chunked, beside verify steps."""
    from transformers import AutoModelForCausalLM

    path = tiny_model("deepseek_v3")
    prompts = workload(1)[:3]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logps = [torch.log_softmax(model(torch.tensor([p])).logits[0].float(), -1)
                 for p in prompts]
    spec = ["spec.algorithm=nextn", "spec.max_batch_size=0", "spec.num_steps=2",
            "scheduler.overlap=true", "scheduler.chunked_prefill_size=8"]
    with Engine(path, FP32_CPU + spec) as eng:
        assert eng.runner.draft is not None
        outs = eng.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 6},
                            logprob_start_len=0)
        assert sum(o["meta"].get("spec_verify_steps", 0) for o in outs) > 0
        for prompt, logp, out in zip(prompts, logps, outs):
            assert_close(out["meta"]["input_logprobs"], expected(prompt, logp, 0))
        assert eng.scheduler.is_memory_clean()
