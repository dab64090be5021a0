"""A trained NextN head (spec.draft_path) for a model without an MTP layer: the file format loads
strictly, the head computes what the same weights compute in transformers' own decoder layer, and
serving with it is lossless (greedy outputs equal plain decoding)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from parity import FP32_CPU, ID_VOCAB, hf_model, make_runner, prompts_of_lengths, rel_err
from safetensors.torch import save_file

from moeserve import Engine
from moeserve.core import ForwardMode
from moeserve.models.loader import WeightLoadError


def _dense_layer(ref, layer_idx: int):
    """transformers' decoder layer the head of `ref`'s model has: its own layer class, or for a
    Qwen3-MoE target a dense Qwen3 layer of its intermediate_size."""
    cfg = ref.config
    if cfg.model_type != "qwen3_moe":
        return type(ref.model.layers[-1])(cfg, layer_idx=layer_idx)
    import transformers

    dense = transformers.Qwen3Config(**{k: v for k, v in cfg.to_dict().items()
                                        if k not in ("model_type", "architectures")})
    dense._attn_implementation = cfg._attn_implementation  # sdpa: causal without a mask
    return transformers.models.qwen3.modeling_qwen3.Qwen3DecoderLayer(dense, layer_idx)


def write_head(path: str, model_dir: str, seed: int = 0) -> str:
    """A head file in the trainer's format with random weights (transformers' names)."""
    ref = hf_model(model_dir)
    cfg = ref.config
    gen = torch.Generator().manual_seed(seed)
    layer = _dense_layer(ref, cfg.num_hidden_layers - 1)
    tensors = {f"layer.{k}": torch.randn(v.shape, generator=gen) * 0.1 + (k.endswith(
        "norm.weight") * 1.0) for k, v in layer.state_dict().items()}
    h = cfg.hidden_size
    tensors.update({"enorm.weight": 1 + 0.1 * torch.randn(h, generator=gen),
                    "hnorm.weight": 1 + 0.1 * torch.randn(h, generator=gen),
                    "norm.weight": 1 + 0.1 * torch.randn(h, generator=gen),
                    "eh_proj.weight": 0.1 * torch.randn(h, 2 * h, generator=gen)})
    os.makedirs(path, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path,
                                                                          "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"architecture": "NextNHead", "target_architecture": cfg.architectures[0],
                   "hidden_size": h, "vocab_size": cfg.vocab_size}, f)
    return path


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


@torch.no_grad()
def _reference(model_dir: str, head_dir: str, ids: list[int]) -> torch.Tensor:
    """transformers: the target's post-norm hidden states, then the head's block as a
    transformers decoder layer (causal SDPA) → logits predicting t_{i+2} at positions 0..n-2."""
    from safetensors.torch import load_file

    ref = hf_model(model_dir)
    cfg, w = ref.config, load_file(os.path.join(head_dir, "model.safetensors"))
    out = ref(torch.tensor([ids]), output_hidden_states=True)
    hidden = out.hidden_states[-1][0, :-1]  # h_i, i = 0..n-2
    emb = ref.model.embed_tokens(torch.tensor(ids[1:]))  # embed(t_{i+1})
    eps = cfg.rms_norm_eps
    x = torch.cat([_rms(emb, w["enorm.weight"], eps), _rms(hidden, w["hnorm.weight"], eps)], -1)
    x = (x @ w["eh_proj.weight"].T)[None]
    layer = _dense_layer(ref, 0).float().eval()
    layer.load_state_dict({k[len("layer."):]: v for k, v in w.items() if k.startswith("layer.")})
    positions = torch.arange(len(ids) - 1)[None]
    rope = ref.model.rotary_emb(x, positions)
    x = layer(x, position_embeddings=rope, position_ids=positions)
    x = x[0] if isinstance(x, tuple) else x
    return ref.lm_head(_rms(x[0], w["norm.weight"], eps))


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe"])
def test_head_matches_transformers_layer(tiny_model, tmp_path, arch):
    model_dir = tiny_model(arch)
    head_dir = write_head(str(tmp_path / "head"), model_dir)
    runner = make_runner(model_dir, [f"spec.algorithm=nextn", f"spec.draft_path={head_dir}"])
    assert runner.draft.kind == "head" and len(runner.memory.pool.k) == (
        runner.hf_config.num_hidden_layers + 1)  # the head's own KV layer
    ids = prompts_of_lengths([11], runner.hf_config.vocab_size, seed=3)[0]
    (row,) = runner.memory.req_to_token.alloc(1)
    slots = runner.memory.allocator.alloc(len(ids) - 1)
    runner.memory.req_to_token.write(row, 0, slots)
    fb = runner.make_batch(ForwardMode.EXTEND, ids[:-1], list(range(len(ids) - 1)), slots,
                           [row], [0], [len(ids) - 1], return_all_logits=True)
    with torch.inference_mode():
        hidden = runner.forward_hidden(fb)
        runner.attn_backend.init_forward_metadata(fb)
        ours = runner.draft.logits(runner.draft.forward(fb, torch.tensor(ids[1:]), hidden))
    assert rel_err(ours, _reference(model_dir, head_dir, ids)) < 1e-4


def test_head_for_another_model_is_refused(tiny_model, tmp_path):
    head_dir = write_head(str(tmp_path / "head"), tiny_model("llama"))
    with open(os.path.join(head_dir, "config.json")) as f:
        cfg = json.load(f)
    cfg["hidden_size"] += 1
    with open(os.path.join(head_dir, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(WeightLoadError, match="hidden_size"):
        make_runner(tiny_model("llama"), ["spec.algorithm=nextn", f"spec.draft_path={head_dir}"])


@pytest.mark.parametrize("arch,overlap", [("llama", False), ("llama", True), ("qwen3_moe", True)])
def test_serving_with_head_equals_plain(tiny_model, tmp_path, arch, overlap):
    model_dir = tiny_model(arch, vocab_size=ID_VOCAB)
    head_dir = write_head(str(tmp_path / "head"), model_dir)
    prompts = prompts_of_lengths([5, 17, 9, 30], 1000, seed=1)
    params = [{"temperature": 0, "ignore_eos": True, "max_new_tokens": n} for n in (12, 3, 20, 7)]
    loop = [f"scheduler.overlap={str(overlap).lower()}"]
    with Engine(model_dir, FP32_CPU + loop) as eng:
        want = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=params)]
    with Engine(model_dir, FP32_CPU + loop + ["spec.algorithm=nextn", "spec.max_batch_size=0",
        "spec.num_steps=3",
                                              f"spec.draft_path={head_dir}"]) as eng:
        outs = eng.generate(input_ids=prompts, sampling_params=params)
        assert [o["output_ids"] for o in outs] == want
        assert eng.scheduler.is_memory_clean()


def test_dummy_head_draft_vocabulary(tiny_model):
    """`dummy:D` scores D tokens (plain `dummy` the trainer's default D), stays lossless, and a
    malformed size is a config error naming the key."""
    from moeserve.config import ConfigError

    model_dir = tiny_model("llama")
    runner = make_runner(model_dir, ["spec.algorithm=nextn", "spec.draft_path=dummy:64"])
    assert runner.draft.lm_head.weight.shape[0] == 64 and runner.draft.vocab.tolist() == list(
        range(64))
    full = make_runner(model_dir, ["spec.algorithm=nextn", "spec.draft_path=dummy:0"])
    assert full.draft.vocab is None
    with pytest.raises(ConfigError, match="spec.draft_path"):
        make_runner(model_dir, ["spec.algorithm=nextn", "spec.draft_path=dummy:x"])
    prompts = prompts_of_lengths([5, 17], 1000, seed=2)
    params = [{"temperature": 0, "ignore_eos": True, "max_new_tokens": n} for n in (9, 14)]
    with Engine(model_dir, FP32_CPU) as eng:
        want = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=params)]
    with Engine(model_dir, FP32_CPU + ["spec.algorithm=nextn", "spec.max_batch_size=0",
                                       "spec.draft_path=dummy:64"]) as eng:
        outs = eng.generate(input_ids=prompts, sampling_params=params)
        assert [o["output_ids"] for o in outs] == want
