"""DeepSeek-V2 / V3 (MLA, grouped routing, shared experts, YaRN, MTP) vs transformers, fp32."""

from __future__ import annotations

import pytest
import torch
from parity import hf_logits, hf_model, make_runner, prefill_logits, prompts_of_lengths, rel_err
from safetensors import safe_open

from moeserve.core import ForwardMode
from moeserve.models.loader import WeightLoadError, iterate_weights, load_weights
from moeserve.models.registry import model_class
from moeserve.runtime.model_config import load_hf_config

ARCHS = ["deepseek_v2", "deepseek_v3"]
# (arch, config overrides): the make_tiny defaults (V2: no q LoRA, group_limited_greedy; V3: q LoRA,
# sigmoid + bias, 4 groups; both YaRN) plus the other rope / routing / projection variants.
VARIANTS = [
    ("deepseek_v2", {}),
    ("deepseek_v2", {"topk_method": "greedy"}),
    ("deepseek_v3", {}),
    ("deepseek_v3", {"rope_interleave": False}),
    ("deepseek_v3", {"q_lora_rank": None, "n_group": 1, "topk_group": 1}),
]


def _checkpoint(path: str) -> dict[str, torch.Tensor]:
    with safe_open(f"{path}/model.safetensors", framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.mark.parametrize("arch,overrides", VARIANTS)
def test_prefill_logits_match_transformers(tiny_model, arch, overrides):
    path = tiny_model(arch, **overrides)
    runner, ref = make_runner(path), hf_model(path)
    prompts = prompts_of_lengths([5, 17, 90], runner.hf_config.vocab_size)
    for ours, prompt in zip(prefill_logits(runner, prompts), prompts):  # one batch, 3 requests
        assert rel_err(ours, hf_logits(ref, prompt)) < 1e-4


# greedy generation and decode-vs-recompute for V2/V3 live in test_dense_and_moe.py (all archs)


@pytest.mark.parametrize("arch", ARCHS)
def test_mtp_weights_skipped_by_default(tiny_model, arch):
    runner = make_runner(tiny_model(arch))  # loading is strict: MTP tensors must be skipped
    n = runner.hf_config.num_hidden_layers
    assert runner.model.kv_layout()["layers"] == n == len(runner.memory.pool.kv)
    assert not any(name.startswith(f"model.layers.{n}.") for name, _ in
                   runner.model.named_parameters())


def _hf_block(ref, ckpt: dict[str, torch.Tensor], layer: int) -> torch.nn.Module:
    """transformers' decoder layer holding the checkpoint's MTP block weights (experts fused)."""
    block = type(ref.model.layers[-1])(ref.config, layer_idx=layer).float().eval()
    prefix, state = f"model.layers.{layer}.", {}
    for name, t in ckpt.items():
        if name.startswith(prefix) and ".experts." not in name:
            state[name[len(prefix):]] = t
    num_experts = ref.config.n_routed_experts

    def expert(i: int, proj: str) -> torch.Tensor:
        return ckpt[f"{prefix}mlp.experts.{i}.{proj}.weight"]

    state["mlp.experts.gate_up_proj"] = torch.stack(
        [torch.cat([expert(i, "gate_proj"), expert(i, "up_proj")]) for i in range(num_experts)])
    state["mlp.experts.down_proj"] = torch.stack(
        [expert(i, "down_proj") for i in range(num_experts)])
    block.load_state_dict(state, strict=False)  # the MTP extras (enorm, ...) are not block weights
    return block


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@torch.no_grad()
def _mtp_reference(ref, ckpt, ids: list[int], hidden: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3 NextN written out: eh_proj(cat(enorm(emb), hnorm(h))) → block → norm → head."""
    n, eps = ref.config.num_hidden_layers, ref.config.rms_norm_eps
    p = f"model.layers.{n}."
    emb = ckpt[p + "embed_tokens.weight"][torch.tensor(ids)]
    x = torch.cat([_rms(emb, ckpt[p + "enorm.weight"], eps),
                   _rms(hidden, ckpt[p + "hnorm.weight"], eps)], dim=-1)
    x = x @ ckpt[p + "eh_proj.weight"].T  # [T, hidden]
    positions = torch.arange(len(ids))[None]
    rope = ref.model.rotary_emb(x[None], positions)
    x = _hf_block(ref, ckpt, n)(x[None], position_embeddings=rope, position_ids=positions)[0]
    return _rms(x, ckpt[p + "shared_head.norm.weight"], eps) @ ckpt[p + "shared_head.head.weight"].T


@pytest.mark.parametrize("arch", ARCHS)
def test_mtp_layer_loads_strictly_and_matches_reference(tiny_model, arch):
    path = tiny_model(arch)
    runner = make_runner(path, ["model.load_mtp=true"])  # strict: raises on missing/unexpected
    model, ckpt, n = runner.model, _checkpoint(path), runner.hf_config.num_hidden_layers
    assert model.kv_layout()["layers"] == n + 1 == len(runner.memory.pool.kv)
    params = dict(model.named_parameters())
    for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                 "self_attn.kv_b_proj.weight", "mlp.gate.weight"):
        assert torch.equal(params[f"model.layers.{n}.{name}"], ckpt[f"model.layers.{n}.{name}"])
    # NOTE: embedding and head are shared with the target; the checkpoint's copies are identical.
    for name, main in (("embed_tokens.weight", "model.embed_tokens.weight"),
                       ("shared_head.head.weight", "lm_head.weight")):
        assert torch.equal(ckpt[f"model.layers.{n}.{name}"], params[main])

    ids = prompts_of_lengths([13], runner.hf_config.vocab_size, seed=4)[0]
    (row,) = runner.memory.req_to_token.alloc(1)
    slots = runner.memory.allocator.alloc(len(ids))
    runner.memory.req_to_token.write(row, 0, slots)
    fb = runner.make_batch(ForwardMode.EXTEND, ids, list(range(len(ids))), slots, [row], [0],
                           [len(ids)], return_all_logits=True)
    with torch.inference_mode():
        runner.attn_backend.init_forward_metadata(fb)
        hidden = model(fb)  # the target's hidden states feed the draft layer
        ours = model.compute_logits(model.forward_mtp(fb, hidden))
    assert rel_err(ours, _mtp_reference(hf_model(path), ckpt, ids, hidden)) < 1e-4


def _load(path: str, edit) -> None:
    """Load the checkpoint at `path`, passed through `edit(name, tensor) -> [(name, tensor)]`."""
    cfg = load_hf_config(path)
    model = model_class(cfg.architectures[0])(cfg)
    load_weights(model, (nt for name, t in iterate_weights(path, torch.float32, progress=False)
                         for nt in edit(name, t)))


def test_complete_checkpoint_loads(tiny_model):
    _load(tiny_model("deepseek_v3"), lambda name, t: [(name, t)])


@pytest.mark.parametrize("arch,victim", [
    ("deepseek_v3", "model.layers.1.self_attn.kv_b_proj.weight"),
    ("deepseek_v3", "model.layers.2.mlp.gate.e_score_correction_bias"),
    ("deepseek_v3", "model.layers.1.self_attn.q_a_layernorm.weight"),
    ("deepseek_v2", "model.layers.0.self_attn.q_proj.weight"),
    ("deepseek_v2", "model.layers.2.mlp.shared_experts.up_proj.weight"),
])
def test_missing_tensor_is_named(tiny_model, arch, victim):
    param = victim.replace("up_proj", "gate_up_proj")
    with pytest.raises(WeightLoadError, match=param.replace(".", r"\.")):
        _load(tiny_model(arch), lambda name, t: [] if name == victim else [(name, t)])


def test_missing_expert_is_named(tiny_model):
    victim = "model.layers.1.mlp.experts.5.down_proj.weight"
    with pytest.raises(WeightLoadError, match=r"model\.layers\.1\.mlp\.experts\.w2.*5"):
        _load(tiny_model("deepseek_v3"), lambda name, t: [] if name == victim else [(name, t)])


def test_extra_tensor_is_named(tiny_model):
    extra = "model.layers.0.self_attn.kv_c_proj.weight"
    with pytest.raises(WeightLoadError, match=extra.replace(".", r"\.")):
        _load(tiny_model("deepseek_v3"), lambda name, t: [(name, t)] + (
            [(extra, t)] if name.endswith("kv_b_proj.weight") else []))


@pytest.mark.parametrize("victim", ["model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
                                    "model.layers.1.mlp.gate.weight"])
def test_wrong_shape_is_named(tiny_model, victim):
    with pytest.raises(WeightLoadError, match=victim.replace(".", r"\.")):
        _load(tiny_model("deepseek_v3"), lambda name, t: [(name, t[1:] if name == victim else t)])
