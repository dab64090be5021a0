"""make_tiny: tiny checkpoints load in transformers, round-trip exactly, look like real files."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch

from moeserve.tools.make_tiny import ARCHS, DEEPSEEK_ARCHS, build_tiny_model, main, make_tiny
from moeserve.tools.tiny_checkpoint import hf_mtp_model, read_checkpoint

transformers = pytest.importorskip("transformers")

PROMPT = [{"role": "user", "content": "Hello, what is two plus two?"}]


@pytest.fixture(scope="module")
def ckpt(tiny_model, tmp_path_factory):
    """make_tiny(arch, seed=0) checkpoints: the session's (conftest), the sharded ones here."""
    cache: dict[str, str] = {}

    def get(arch: str, shard: bool = False) -> str:
        if not shard:
            return tiny_model(arch)
        if arch not in cache:
            out = tmp_path_factory.mktemp(f"{arch}_shard")
            cache[arch] = make_tiny(arch, str(out), seed=0, shard=True)
        return cache[arch]

    return get


def _load(path: str, **kwargs):
    return transformers.AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()


def _chat_ids(path: str) -> torch.Tensor:
    """PROMPT's ids by `path`'s tokenizer, loaded once per content of its files: every tiny
    checkpoint holds the same tokenizer (test_tokenizer_and_config loads each folder's), and
    loading the 129k-token tokenizer takes ~0.7 s of a core."""
    digest = hashlib.sha256()
    for name in sorted(os.listdir(path)):
        if name.startswith(("tokenizer", "chat_template", "special_tokens")):
            with open(os.path.join(path, name), "rb") as f:
                digest.update(name.encode() + b"\0" + f.read())
    key = digest.hexdigest()
    if key not in _CHAT_IDS:
        tok = transformers.AutoTokenizer.from_pretrained(path)
        _CHAT_IDS[key] = tok.apply_chat_template(PROMPT, add_generation_prompt=True,
                                                 return_dict=True)["input_ids"]
    return torch.tensor([_CHAT_IDS[key]])


_CHAT_IDS: dict[str, list[int]] = {}  # by the digest of a folder's tokenizer files


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_loads_and_round_trips(ckpt, arch):
    path = ckpt(arch)
    ids = _chat_ids(path)
    with torch.no_grad():
        got = _load(path)(ids).logits
        want = build_tiny_model(arch, seed=0)(ids).logits
    assert torch.isfinite(got).all()
    assert got.std() > 1e-2 and (got[0, 0] - got[0, -1]).abs().max() > 1e-3  # not degenerate
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_tokenizer_and_config(ckpt, arch):
    path = ckpt(arch)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    text = tok.apply_chat_template(
        [{"role": "system", "content": "S"}, *PROMPT, {"role": "assistant", "content": "4"}],
        tokenize=False,
    )
    assert text == (
        "<｜begin▁of▁sentence｜>S<｜User｜>Hello, what is two plus two?"
        "<｜Assistant｜>4<｜end▁of▁sentence｜>"
    )
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["vocab_size"] == len(tok) == 129280
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (tok.bos_token_id, tok.eos_token_id)
    assert "rope_theta" in cfg and "rope_parameters" not in cfg  # legacy layout, like real files


@pytest.mark.parametrize(
    "arch, expert_key",
    [
        ("qwen3_moe", "model.layers.1.mlp.experts.7.gate_proj.weight"),
        ("mixtral", "model.layers.1.block_sparse_moe.experts.7.w1.weight"),
        ("deepseek_v2", "model.layers.2.mlp.experts.7.up_proj.weight"),
        ("deepseek_v3", "model.layers.2.mlp.experts.15.down_proj.weight"),
    ],
)
def test_per_expert_naming(ckpt, arch, expert_key):
    keys = read_checkpoint(ckpt(arch)).keys()
    assert expert_key in keys
    assert not [k for k in keys if k.endswith(("gate_up_proj", "experts.down_proj"))]


def test_tied_qwen2_has_no_lm_head(ckpt):
    assert "lm_head.weight" not in read_checkpoint(ckpt("qwen2"))


@pytest.mark.parametrize("arch", DEEPSEEK_ARCHS)
def test_deepseek_mtp_layer(ckpt, arch):
    path = ckpt(arch)
    tensors = read_checkpoint(path)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    n, h = cfg["num_hidden_layers"], cfg["hidden_size"]
    assert cfg["num_nextn_predict_layers"] == 1
    p = f"model.layers.{n}."
    assert tensors[p + "eh_proj.weight"].shape == (h, 2 * h)
    norms = ("enorm", "hnorm", "shared_head.norm", "input_layernorm", "post_attention_layernorm")
    for name in norms:
        assert tensors[p + name + ".weight"].shape == (h,)
    assert torch.equal(tensors[p + "shared_head.head.weight"], tensors["lm_head.weight"])
    assert torch.equal(tensors[p + "embed_tokens.weight"], tensors["model.embed_tokens.weight"])
    assert {k[len(p) :] for k in tensors if k.startswith(p + "mlp.")} >= {
        "mlp.gate.weight",
        "mlp.shared_experts.gate_proj.weight",
        "mlp.experts.0.gate_proj.weight",
        "mlp.experts.7.down_proj.weight",
    }
    assert (p + "mlp.gate.e_score_correction_bias" in tensors) == (arch == "deepseek_v3")

    # transformers' own MTP module accepts the layer: the oracle for MTP drafting
    model = _load(path)
    mtp = hf_mtp_model(model, path)
    ids = _chat_ids(path)
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True).hidden_states[-1]  # last layer, pre-norm
        pos = torch.arange(1, ids.shape[1] + 1)[None]
        out = mtp.forward_layer(0, hidden, pos, None, input_ids=torch.roll(ids, -1, dims=1))
        logits = mtp._project_to_logits(out)
    assert torch.isfinite(logits).all() and logits.std() > 1e-2


def test_deepseek_eager_matches_sdpa(ckpt):
    """MLA head counts are consistent (num_key_value_heads == num_attention_heads)."""
    path = ckpt("deepseek_v3")
    ids = _chat_ids(path)
    with torch.no_grad():
        eager = _load(path, attn_implementation="eager")(ids).logits
        sdpa = _load(path, attn_implementation="sdpa")(ids).logits
    torch.testing.assert_close(eager, sdpa, atol=1e-5, rtol=1e-5)


def test_v3_score_correction_bias_survives_and_matters(ckpt):
    path = ckpt("deepseek_v3")
    model = _load(path)
    gate = model.model.layers[1].mlp.gate
    assert gate.e_score_correction_bias.abs().min() > 0
    ref = build_tiny_model("deepseek_v3", seed=0).model.layers[1].mlp.gate
    assert torch.equal(gate.e_score_correction_bias, ref.e_score_correction_bias)
    hidden = torch.randn(64, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, _, with_bias = gate(hidden)
        gate.e_score_correction_bias.zero_()
        _, _, without_bias = gate(hidden)
    assert not torch.equal(with_bias.sort(-1).values, without_bias.sort(-1).values)


@pytest.mark.parametrize("arch", DEEPSEEK_ARCHS)
def test_deepseek_yarn(ckpt, arch):
    model = _load(ckpt(arch))
    rope = model.config.rope_parameters
    assert rope["rope_type"] == "yarn" and rope["factor"] == 4.0
    assert model.config.max_position_embeddings > rope["original_max_position_embeddings"]
    scaling = model.model.rotary_emb.attention_scaling  # mscale / mscale_all_dim ratio on cos/sin
    assert (scaling != 1.0) == (arch == "deepseek_v3")


def test_sharded_index_loads(ckpt):
    path = ckpt("deepseek_v3", shard=True)
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        index = json.load(f)
    files = sorted(set(index["weight_map"].values()))
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert not os.path.exists(os.path.join(path, "model.safetensors"))
    assert read_checkpoint(path).keys() == read_checkpoint(ckpt("deepseek_v3")).keys()
    ids = _chat_ids(path)
    with torch.no_grad():
        got = _load(path)(ids).logits
        want = _load(ckpt("deepseek_v3"))(ids).logits
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_cli_with_layers_and_override(tmp_path, capsys):
    main(["--arch", "qwen3_moe", "--out", str(tmp_path), "--layers", "3", "--set", "num_experts=4"])
    assert capsys.readouterr().out.strip() == str(tmp_path)
    cfg = _load(str(tmp_path)).config
    assert (cfg.num_hidden_layers, cfg.num_experts) == (3, 4)


def test_draftable_mtp_predicts_the_targets_next_token(tmp_path):
    """draftable: transformers' own MTP module over the checkpoint drafts the token the target
    itself predicts next (argmax at t+1) at most positions; the plain random layer almost never.
    The checkpoint is still build_tiny_model(draftable=True)."""
    rates = {}
    for draftable in (False, True):
        path = make_tiny("deepseek_v3", str(tmp_path / str(draftable)), draftable=draftable)
        model, ids = _load(path), _chat_ids(path)
        mtp = hf_mtp_model(model, path)
        with torch.no_grad():
            out = model(ids, output_hidden_states=True)
            hidden = out.hidden_states[-1]
            pos = torch.arange(1, ids.shape[1] + 1)[None]
            draft = mtp._project_to_logits(mtp.forward_layer(
                0, hidden, pos, None, input_ids=torch.roll(ids, -1, dims=1)))
            want = build_tiny_model("deepseek_v3", seed=0, draftable=draftable)(ids).logits
        torch.testing.assert_close(out.logits, want, atol=1e-6, rtol=0)
        # draft at t (reading token t+1) against the target's argmax at t+1
        agree = draft[0, :-1].argmax(-1) == out.logits[0, 1:].argmax(-1)
        rates[draftable] = agree.float().mean().item()
    assert rates[True] >= 0.4 and rates[False] < 0.1, rates  # measured: 0.5 and 0.0
