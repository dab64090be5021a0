"""The NextN trainer on a tiny random Llama: chained training matches serving-time chaining, loss
falls, the file format round-trips, and a resumed run equals an uninterrupted one."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from moeserve.spec_mtp.training import train as train_mod
from moeserve.spec_mtp.training import train_data as data
from moeserve.spec_mtp.training.train_eval import collate, evaluate
from moeserve.spec_mtp.training.train_head import (TrainHead, _ChainKV, chain_mask, load_head,
                                                   save_head)

LAYER_NAMES = {
    "layer.self_attn.q_proj.weight", "layer.self_attn.k_proj.weight",
    "layer.self_attn.v_proj.weight", "layer.self_attn.o_proj.weight",
    "layer.mlp.gate_proj.weight", "layer.mlp.up_proj.weight", "layer.mlp.down_proj.weight",
    "layer.input_layernorm.weight", "layer.post_attention_layernorm.weight",
}
HEAD_NAMES = {"enorm.weight", "hnorm.weight", "eh_proj.weight", "norm.weight"} | LAYER_NAMES
CONFIG_KEYS = {"architecture", "target_architecture", "hidden_size", "vocab_size",
               "num_attention_heads", "num_key_value_heads", "intermediate_size",
               "rms_norm_eps", "trained_steps", "prompts", "tokens"}
PROMPTS = ["Explain rivers.", "Write a poem about tea.", "What is chess?", "Describe glaciers.",
           "Give tips for sleep.", "Why is the sky blue?"]


@pytest.fixture(scope="module")
def tiny(tiny_model):
    """(target, tokenizer, records): greedy answers of the tiny model and its hidden states."""
    torch.manual_seed(0)
    target, tokenizer = data.load_target(tiny_model("llama"))
    ids = data.chat_ids(tokenizer, PROMPTS)
    generated = data.generate_hf(target, tokenizer, ids, max_new=12, batch=4)
    return target, tokenizer, data.make_records(target, ids, generated)


def test_generate_hf_captures_forward_hidden_states(tiny):
    """The hidden states hooked out of batched, left-padded generation equal one plain forward
    over prompt + answer, and the answers are the target's greedy tokens."""
    target, _, records = tiny
    assert all(len(r["tokens"]) - r["prompt_len"] == 12 for r in records)
    for r in records:
        ids = r["tokens"].long().tolist()
        ref = data.hidden_states(target, ids)
        torch.testing.assert_close(r["hidden"], ref, rtol=1e-4, atol=1e-4)
        greedy = (ref @ target.lm_head.weight.T).argmax(-1)  # the next token at each position
        assert greedy[r["prompt_len"] - 1: -1].tolist() == ids[r["prompt_len"]:]
        assert torch.equal(r["topk"][:, 0].long(), greedy)


def _cfg(**kw):
    cfg = dict(lr=1e-2, batch_size=3, seed=0, chain_steps=3, detach=False, feature_weight=0.0,
               prompt_loss=True, init="random", weight_decay=0.0, warmup=2, save_every=2,
               total_steps=6, negatives=256)
    return cfg | kw


def test_chain_mask_layout():
    allowed = chain_mask(5, 2, torch.float32)[0, 0] == 0  # [4 queries j=1..4, 5 + 4 keys]
    assert allowed.shape == (4, 9)
    # step 2 at j=3 started at p=2: teacher-forced keys 0..2 and its own step-2 key at 3 (block 2
    # holds positions 1..4 at columns 5..8)
    assert allowed[3 - 1].nonzero().flatten().tolist() == [0, 1, 2, 5 + 3 - 1]
    step3 = chain_mask(6, 3, torch.float32)[0, 0] == 0  # queries j=2..5; blocks 6, 5, 4 keys
    assert step3[4 - 2].nonzero().flatten().tolist() == [0, 1, 2, 6 + 3 - 1, 11 + 4 - 2]
    assert step3.any(dim=1).all()  # no empty row (no NaN for positions without a chain)
    late = chain_mask(6, 3, torch.float32, first=2)[0, 0] == 0  # j=4..5; blocks 6, 3, 2 keys
    assert late.shape == (2, 11)
    assert late[0].nonzero().flatten().tolist() == [0, 1, 2, 6 + 0, 9 + 0]  # j=4, p=2


def test_chain_from_first_equals_full_chain(tiny):
    """Skipping chains that start before `first` changes no output of the ones after it."""
    target, _, records = tiny
    head = TrainHead(target).eval()
    batch = collate(records[:3], target.get_input_embeddings())
    first = int(batch.start.min())
    assert first > 2
    with torch.no_grad():
        torch.nn.init.normal_(head.eh_proj.weight, std=0.05)
        full = head.chain(batch.embeds, batch.hidden, steps=3)
        late = head.chain(batch.embeds, batch.hidden, steps=3, first=first)
    for k, (a, b) in enumerate(zip(full, late), 1):
        start = 0 if k == 1 else first + k - 1
        torch.testing.assert_close(b[:, start:], a[:, start:], rtol=1e-4, atol=1e-5)
        assert not b[:, :start].any()


def test_chain_equals_serving_order(tiny):
    """Step 2 of `chain` at p+1 equals running the head as serving does: teacher-forced prefix
    0..p, then one step on the head's own output with the drafted token's embedding."""
    target, _, records = tiny
    head = TrainHead(target).eval()
    batch = collate(records[:1], target.get_input_embeddings())
    with torch.no_grad():
        torch.nn.init.normal_(head.eh_proj.weight, std=0.05)  # not the identity init
        o1, o2 = head.chain(batch.embeds, batch.hidden, steps=2)
        p = batch.labels.shape[1] // 2
        e = head.enorm(torch.cat([batch.embeds[:, : p + 1], batch.embeds[:, p + 1: p + 2]], 1))
        h = torch.cat([batch.hidden[:, : p + 1], o1[:, p: p + 1]], dim=1)
        pos = torch.arange(p + 2).unsqueeze(0)
        mask = chain_mask(p + 2, 1, torch.float32)
        serve = head.step(e, h, mask, head.rotary(e, pos), _ChainKV(), pos)
    torch.testing.assert_close(serve[0, -1], o2[0, p + 1], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(serve[0, : p + 1], o1[0, : p + 1], rtol=1e-4, atol=1e-5)


def test_few_steps_reduce_loss(tiny):
    """Full-vocabulary loss and accuracy before/after 30 steps on candidate-softmax training.

    The tiny model's frozen LM head has N(0, 0.02) rows, so its logits span about +-1 and the
    cross-entropy over 129k tokens cannot fall far: accuracy is the sharper signal here."""
    target, _, records = tiny
    torch.manual_seed(0)
    trainer = train_mod.Trainer(TrainHead(target), target, records, _cfg(total_steps=30), "")
    lm_head = target.get_output_embeddings().weight
    batch = collate(records, target.get_input_embeddings(), prompt_loss=True)
    full = trainer.cfg | {"negatives": None}
    with torch.no_grad():
        before, accs_before = train_mod.step_loss(trainer.head, batch, lm_head, full)
    for _ in range(30):
        trainer.train_step()
    with torch.no_grad():
        after, accs = train_mod.step_loss(trainer.head, batch, lm_head, full)
    assert float(after) < float(before) - 1.5, (float(before), float(after))
    assert max(accs_before) < 0.05 and min(accs) > 0.5, (accs_before, accs)


def test_fit_deadline_shrinks_then_grows_back_to_the_plan(tiny, monkeypatch):
    """The step count follows the pace: slow steps cut it to what fits before the deadline,
    faster ones restore it, never past the planned count nor below the steps already done."""
    target, _, records = tiny
    trainer = train_mod.Trainer(TrainHead(target), target, records, _cfg(total_steps=100), "")

    class Bar:
        total = 100

        def set_description(self, _):
            pass

    clock = {"now": 0.0}
    monkeypatch.setattr(train_mod.time, "time", lambda: clock["now"])
    bar = Bar()
    trainer.step, clock["now"] = 10, 20.0  # 2 s per step since (0 s, step 0); 40 s left
    trainer._fit_deadline((0.0, 0), 60.0, bar)
    assert trainer.cfg["total_steps"] == bar.total == 30
    trainer.step, clock["now"] = 20, 25.0  # now 1.25 s per step; 35 s left: 28 more
    trainer._fit_deadline((0.0, 0), 60.0, bar)
    assert trainer.cfg["total_steps"] == 48
    trainer.step, clock["now"] = 40, 22.0  # 0.55 s per step; 38 s left: 69 more, past the plan
    trainer._fit_deadline((0.0, 0), 60.0, bar)
    assert trainer.cfg["total_steps"] == 100
    clock["now"] = 70.0  # past the deadline: stop where it is
    trainer._fit_deadline((0.0, 0), 60.0, bar)
    assert trainer.cfg["total_steps"] == 40


def test_save_load_round_trip(tiny, tmp_path):
    target, _, _ = tiny
    head = TrainHead(target)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.01 * torch.randn(p.shape))
    save_head(head, target, str(tmp_path), {"trained_steps": 7, "prompts": 6, "tokens": 60})
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert set(tensors) == HEAD_NAMES
    h = target.config.hidden_size
    assert tensors["eh_proj.weight"].shape == (h, 2 * h)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert set(cfg) == CONFIG_KEYS
    assert cfg["architecture"] == "NextNHead" and cfg["target_architecture"] == "LlamaForCausalLM"
    assert (cfg["hidden_size"], cfg["trained_steps"]) == (h, 7)
    loaded, _ = load_head(str(tmp_path), target)
    for name, t in head.head_state_dict().items():
        assert torch.equal(loaded.head_state_dict()[name], t), name
        assert torch.equal(tensors[name], t), name


@pytest.mark.parametrize("noise", [0.0, 0.1])
def test_resume_equals_uninterrupted(tiny, tmp_path, noise):
    """Ctrl-C at step 3 saves the checkpoint; resuming to step 6 gives the same weights as one
    uninterrupted 6-step run (the data cursor and AdamW state come back; --noise draws from the
    step's own generator, so it comes back too)."""
    target, _, records = tiny

    def fresh_head() -> TrainHead:
        torch.manual_seed(1)  # the same random init for both runs
        return TrainHead(target)

    straight = train_mod.Trainer(fresh_head(), target, records, _cfg(noise=noise), str(tmp_path))
    straight.run(deadline=None)

    part = tmp_path / "part"
    part.mkdir()
    interrupted = train_mod.Trainer(fresh_head(), target, records, _cfg(noise=noise), str(part))
    real_step = interrupted.train_step

    def step_then_interrupt():
        if interrupted.step == 3:
            raise KeyboardInterrupt
        return real_step()

    interrupted.train_step = step_then_interrupt
    with pytest.raises(SystemExit) as exc:
        interrupted.run(deadline=None)
    assert exc.value.code == 130
    assert torch.load(part / "checkpoint.pt", weights_only=False)["step"] == 3

    resumed = train_mod.Trainer(TrainHead(target), target, records, _cfg(noise=noise), str(part))
    resumed.load_checkpoint()
    assert resumed.step == 3 and resumed.cursor(3) == (1, 1)
    resumed.run(deadline=None)
    assert resumed.step == 6
    for name, t in straight.head.head_state_dict().items():
        torch.testing.assert_close(resumed.head.head_state_dict()[name], t, rtol=0, atol=0)
    if noise:  # the noise is applied: the same run without it ends elsewhere
        (tmp_path / "p").mkdir()
        plain = train_mod.Trainer(fresh_head(), target, records, _cfg(), str(tmp_path / "p"))
        plain.run(deadline=None)
        w = "eh_proj.weight"
        assert not torch.equal(plain.head.head_state_dict()[w], straight.head.head_state_dict()[w])


def test_cli_trains_caches_and_evaluates(tiny_model, tmp_path, capsys):
    out = str(tmp_path / "head")
    args = ["--model", tiny_model("llama"), "--out", out, "--num-prompts", "4", "--heldout", "2",
            "--max-new-tokens", "6", "--steps", "3", "--batch-size", "2", "--generator", "hf",
            "--budget-minutes", "0", "--threads", "1"]
    assert train_mod.main(args) == 0
    assert {"model.safetensors", "config.json", "checkpoint.pt"} <= set(os.listdir(out))
    shard = os.path.join(out, "data", "train-0000.pt")
    mtime = os.stat(shard).st_mtime_ns
    assert train_mod.main(["--eval-only", *args]) == 0
    assert os.stat(shard).st_mtime_ns == mtime  # cached data reused, not generated again
    text = capsys.readouterr().out
    assert text.count("| 3 |") == 2 and "accept length" in text
    cfg = json.loads(open(os.path.join(out, "config.json")).read())
    assert cfg["trained_steps"] == 3 and cfg["prompts"] == 4


def test_evaluate_counts_only_full_chains(tiny):
    target, _, records = tiny
    result = evaluate(TrainHead(target), target, records[:2], steps=3)
    answers = sum(len(r["tokens"]) - r["prompt_len"] for r in records[:2])
    assert result["starts"] == answers - 2 * 3  # per record: answer length - steps starts
    assert len(result["rows"]) == 3 and result["accept_length"][0] >= 1.0


@pytest.mark.parametrize("vocab_size", [None, 64])
def test_tree_bound_ranks_against_topk(tiny, vocab_size):
    """The tree bound's step k is accepted iff the label is among torch.topk's k draft tokens
    (over the draft vocabulary when there is one); k=1 walks exactly as the chain does, and a
    wider tree never accepts less."""
    from moeserve.spec_mtp.draft_vocab import pick_vocab
    from moeserve.spec_mtp.training.train_eval import label_ranks

    target, _, records = tiny
    torch.manual_seed(0)
    head = TrainHead(target)
    if vocab_size:
        head.vocab = pick_vocab(records, vocab_size, target.config.vocab_size)
    lm_head = target.get_output_embeddings().weight
    batch = collate(records[:4], target.get_input_embeddings())
    ranks = label_ranks(head, lm_head, batch, 2)
    rows = lm_head if head.vocab is None else lm_head[head.vocab]
    outs = head.chain(batch.embeds, batch.hidden, 2, first=int(batch.start.min()))
    for k in (1, 3):
        for step in range(2):
            with torch.no_grad():
                top = (outs[step] @ rows.T).topk(k, dim=-1).indices
            top = top if head.vocab is None else head.vocab[top]
            expect = (top == batch.labels[..., None]).any(-1)
            valid = batch.valid(step + 1)  # the positions evaluate() counts
            assert valid.sum() > 20 and torch.equal((ranks[step] < k)[valid], expect[valid])
    every = len(rows)  # a "tree" over the whole draft vocabulary accepts every label it has
    result = evaluate(head, target, records, steps=2, tree_topk=(1, 2, every))
    trees = result["tree_accept_length"]
    assert trees[1] == result["accept_length"]
    assert all(a <= b <= c for a, b, c in zip(trees[1], trees[2], trees[every]))
    assert trees[every][1] > 2.0 > trees[1][1]


def test_draft_vocab_training_and_file(tiny, tmp_path):
    """With a draft vocabulary the softmax is over its D tokens: 30 steps learn the greedy
    answers, the file carries the sorted ids (served by spec_mtp/head.py), loading restores them,
    and the evaluation's drafts are vocabulary tokens."""
    from moeserve.spec_mtp.draft_vocab import pick_vocab
    from moeserve.spec_mtp.training.train_eval import chain_correct

    target, _, records = tiny
    vocab = pick_vocab(records, 64, target.config.vocab_size)
    torch.manual_seed(0)
    trainer = train_mod.Trainer(TrainHead(target), target, records, _cfg(total_steps=30), "",
                                vocab)
    batch = collate(records, target.get_input_embeddings(), prompt_loss=True)
    with torch.no_grad():
        before, _ = train_mod.step_loss(trainer.head, batch, trainer.lm_head, trainer.cfg,
                                        vocab=vocab)
    for _ in range(30):
        trainer.train_step()
    with torch.no_grad():
        after, accs = train_mod.step_loss(trainer.head, batch, trainer.lm_head, trainer.cfg,
                                          vocab=vocab)
    assert float(after) < float(before) - 1.0 and min(accs) > 0.5, (before, after, accs)
    save_head(trainer.head, target, str(tmp_path), {"trained_steps": 30})
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert set(tensors) == HEAD_NAMES | {"draft_vocab"}
    assert torch.equal(tensors["draft_vocab"], vocab)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["draft_vocab_size"] == 64
    loaded, _ = load_head(str(tmp_path), target)
    assert torch.equal(loaded.vocab, vocab)
    lm_head = target.get_output_embeddings().weight
    outs = loaded.chain(batch.embeds, batch.hidden, 1)[0]
    with torch.no_grad():  # what chain_correct compares: the argmax over the vocabulary's rows
        drafted = vocab[(outs @ lm_head[vocab].T).argmax(-1)]
        correct = chain_correct(loaded, lm_head, batch, 1)[0]
    assert torch.equal(correct, drafted == batch.labels)


def test_engine_generator_answers_and_hidden_states(tiny, tiny_model):
    """The generator's greedy loop on the runner (float32 here; two groups of at most 4 rows,
    prefills of several prompts) answers as transformers' greedy generate does, and the hidden
    states its own prefill and decode passes computed are transformers' final hidden states for
    prompt + answer."""
    target, tokenizer, _ = tiny
    ids = data.chat_ids(tokenizer, PROMPTS)
    gen = data.EngineGenerator(tiny_model("llama"), 12, 4, dtype="float32", prefill_tokens=64)
    try:
        out = gen(ids)
        reference = data.generate_hf(target, tokenizer, ids, max_new=12, batch=4)
        assert [a for a, _ in out] == [a for a, _ in reference]
        for p, (a, hidden) in zip(ids, out):
            ref = data.hidden_states(target, p + a)
            torch.testing.assert_close(hidden, ref, rtol=1e-4, atol=1e-4)
        # an EOS id inside the answers: each stops after its first one, EOS kept, as served
        eos = {reference[0][0][4], reference[1][0][7]}
        cut = data.generate_with_hidden(gen.engine.runner, ids[:4], 12, eos, prefill_tokens=64)
        for p, (a, _), (got, hidden) in zip(ids, reference, cut):
            stop = next((i + 1 for i, t in enumerate(a) if t in eos), len(a))
            assert got == a[:stop]
            torch.testing.assert_close(hidden, data.hidden_states(target, p + got),
                                       rtol=1e-4, atol=1e-4)
        assert len(cut[0][0]) <= 5 and len(cut[1][0]) <= 8
    finally:
        gen.close()


def test_served_walk_counts_tokens_per_verify_step():
    """Served accept length follows the decode walk, not every chain start: chains start only
    where the last step ended. Here (N=2) the walk's steps start at 0, 3, 4 and 5: 7 tokens in 4
    steps (1.75), while the mean over every start of the same answer is 2.0."""
    from moeserve.spec_mtp.training.train_eval import served_walk

    step1 = [True, True, False, False, False, True, True]  # correct[k][j], 8 answer tokens
    step2 = [False, True, False, False, False, False, True]  # (7 labelled positions)
    assert served_walk([step1, step2], 0, 7, 2) == (7, 4)
    assert served_walk([step1, step2], 0, 7, 1) == (7, 5)
    assert served_walk([step1], 6, 7, 1) == (1, 1)  # one token left: the last step emits one
    assert served_walk([step1], 7, 7, 1) == (0, 0)


def _head_trained_briefly(tiny, out) -> tuple:
    """(target, records, head): 12 training steps on the tiny Llama, saved to `out` and loaded."""
    target, _, records = tiny
    torch.manual_seed(0)
    trainer = train_mod.Trainer(TrainHead(target), target, records, _cfg(total_steps=12), "")
    for _ in range(12):
        trainer.train_step()
    save_head(trainer.head, target, str(out), {"trained_steps": 12})
    return target, records, load_head(str(out), target)[0]


def _served_walk(model: str, spec: list[str], records) -> tuple[int, int, object]:
    """Each record's prompt served at batch 1 (float32, greedy): asserts the record's answer and
    returns (answer tokens after the first, verify steps, the decoder)."""
    from parity import FP32_CPU

    from moeserve import Engine

    tokens = verify = 0
    with Engine(model, FP32_CPU + spec) as eng:
        for r in records:
            prompt, answer = r["tokens"].tolist(), r["tokens"][r["prompt_len"]:].tolist()
            (out,) = eng.generate(input_ids=[prompt[: r["prompt_len"]]],
                                  sampling_params={"temperature": 0, "max_new_tokens": 12})
            assert out["output_ids"] == answer
            tokens += len(answer) - 1  # the first came from prefill
            verify += out["meta"]["spec_verify_steps"]
        assert eng.scheduler.is_memory_clean()
        return tokens, verify, eng.scheduler.worker.spec


def test_evaluated_accept_length_equals_served(tiny, tiny_model, tmp_path):
    """The table's accept length is what the bench measures: a head trained a little, served at
    batch 1 in float32 (its drafts equal the trainer's), gives the evaluation's tokens per verify
    step exactly; the mean over every chain start (which the table once reported as the accept
    length: 1.94 against 1.73 served at N=3 on SmolLM2) does not."""
    target, records, head = _head_trained_briefly(tiny, tmp_path)
    result = evaluate(head, target, records, steps=3)
    spec = ["spec.algorithm=nextn", "spec.num_steps=3", "spec.max_batch_size=0",
            f"spec.draft_path={tmp_path}"]
    tokens, verify, _ = _served_walk(tiny_model("llama"), spec, records)
    assert result["verify_steps"][2] == verify
    assert result["accept_length"][2] == pytest.approx(tokens / verify)
    assert result["accept_length_per_start"][2] != pytest.approx(tokens / verify)  # 1.70, 1.69


def test_pruned_tree_eval_equals_served(tiny, tiny_model, tmp_path):
    """A pruned draft tree served from a head's recorded rank paths: the Engine builds the M
    most counted paths, and its tokens per verify step equal the eval's walk of that tree over
    the same answers (tree_stats.tree_walk); the tree accepts no less than the chain."""
    from moeserve.spec_mtp.training.train_head import write_tree_paths
    from moeserve.spec_mtp.tree import TreeShape
    from moeserve.spec_mtp.tree_stats import paths_from_json, tree_walk

    target, records, head = _head_trained_briefly(tiny, tmp_path)
    result = evaluate(head, target, records, steps=3, tree_nodes=(5,), path_ranks=3)
    write_tree_paths(str(tmp_path), result["tree_paths"], 3)
    shape = TreeShape.best(3, 3, 5, paths_from_json(result["tree_paths"]))
    walked = [tree_walk(a, shape) for a in result["rank_answers"]]
    want = sum(t for t, _ in walked) / sum(v for _, v in walked)
    spec = ["spec.algorithm=nextn", "spec.num_steps=3", "spec.max_batch_size=0", "spec.topk=3",
            "spec.num_draft_tokens=6", f"spec.draft_path={tmp_path}"]
    tokens, verify, decoder = _served_walk(tiny_model("llama"), spec, records)
    assert decoder.shape.paths == shape.paths
    assert sum(v for _, v in walked) == verify and tokens / verify == pytest.approx(want)
    assert any(max(p) > 0 for p in shape.paths)  # not the chain
    assert want >= result["accept_length"][2]  # (the tree is chosen on these answers)
