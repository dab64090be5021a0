"""NextNHead: a trained NextN draft head for a model whose checkpoint has none (Llama, Qwen, SmolLM2).

The same structure as DeepSeek-V3's MTP layer, built from the target's own decoder block:
    o_i = norm(layer(eh_proj([enorm(embed(t_{i+1})) | hnorm(h_i)])))      logits_i = lm_head(o_i)
where h_i is the target's final (post-norm) hidden state at position i, and logits_i predict
t_{i+2}. The embedding and LM head are the target's; only the head's weights are in its file.

File format (written by `python -m moeserve.spec_mtp.training`): DIR/model.safetensors with
`enorm.weight`, `hnorm.weight`, `eh_proj.weight` [hidden, 2 hidden], `norm.weight` and `layer.*`
(transformers' names of the decoder layer: q/k/v/o_proj, gate/up/down_proj, the two norms), plus
DIR/config.json with "architecture": "NextNHead" and the target's shapes. A head trained with a
draft vocabulary (draft_vocab.py) also has `draft_vocab` (sorted int64 token ids [D]) and
"draft_vocab_size": D; its LM head is then those rows of the target's, gathered at load
(`use_vocab`), and drafted indices map back through `vocab`. Heads without it score every token.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from torch import nn

from moeserve.config import ConfigError
from moeserve.forward_batch import ForwardBatch
from moeserve.layers.linear import Linear
from moeserve.layers.norm import RMSNorm
from moeserve.models.llama import MLP, Attention, CausalLM, DecoderLayer
from moeserve.models.loader import WeightLoadError, load_weights
from moeserve.spec_mtp.draft_vocab import DEFAULT_SIZE
from moeserve.spec_mtp.tree_stats import paths_from_json

HEAD_FILE, CONFIG_FILE = "model.safetensors", "config.json"
VOCAB_TENSOR = "draft_vocab"
_SHAPE_KEYS = ("hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads",
               "intermediate_size")
# target architectures whose decoder block the head reuses: (qkv bias, per-head q/k norm)
# (a MoE target's head is a dense block of the config's intermediate_size, as EAGLE heads for
# Qwen3-MoE are: a MoE layer would make every draft pass read its routed experts' bytes)
_FAMILIES = {"LlamaForCausalLM": (False, False), "MistralForCausalLM": (False, False),
             "Qwen2ForCausalLM": (True, False), "Qwen3ForCausalLM": (False, True),
             "Qwen3MoeForCausalLM": (False, True)}


class NextNHead(nn.Module):
    """One decoder block of the target's family between the NextN input projection and a final
    norm; its attention layer id is `layer_id` (one KV layer after the target's)."""

    packed_modules_mapping = CausalLM.packed_modules_mapping  # the loader packs q/k/v, gate/up

    def __init__(self, cfg: Any, layer_id: int):
        super().__init__()
        arch = (getattr(cfg, "architectures", None) or ["?"])[0]
        if arch not in _FAMILIES:
            raise ValueError(f"spec.draft_path: no NextN head for target architecture {arch!r} "
                             f"(supported: {sorted(_FAMILIES)})")
        qkv_bias, qk_norm = _FAMILIES[arch]
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.enorm, self.hnorm, self.norm = RMSNorm(h, eps), RMSNorm(h, eps), RMSNorm(h, eps)
        self.eh_proj = Linear(2 * h, h, bias=False)
        attn = Attention(cfg, layer_id, qkv_bias=qkv_bias, qk_norm=qk_norm)
        self.layer = DecoderLayer(cfg, attn, MLP(h, cfg.intermediate_size))
        self.vocab: torch.Tensor | None = None  # draft index → token id [D]; None: every token
        self.lm_head: Linear | None = None  # the target's LM head rows of `vocab`
        # config.json's rank path counts (tree_stats.py): the nodes of pruned draft trees
        self.tree_paths: dict[tuple[int, ...], float] | None = None

    def use_vocab(self, vocab: torch.Tensor, target_lm_head: torch.Tensor) -> None:
        """Score only `vocab` (sorted ids [D]): copy those rows of the target's LM head [V, H]."""
        h = target_lm_head.shape[1]
        self.vocab = vocab.to(device=target_lm_head.device, dtype=torch.int64)
        self.lm_head = Linear(h, len(vocab), bias=False, device=target_lm_head.device,
                              dtype=target_lm_head.dtype)
        with torch.no_grad():
            self.lm_head.weight.copy_(target_lm_head.detach()[self.vocab])
        self.lm_head.weight.requires_grad_(False)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                fb: ForwardBatch) -> torch.Tensor:
        """embeds (of the next tokens), hidden (target or previous draft): [T, H] → [T, H]."""
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        x, residual = self.layer(x, None, positions, fb)
        return self.norm(x, residual)[0]


def check_head_config(path: str, cfg: Any) -> dict:
    """The head's config.json, checked against the target's shapes (a head trained for another
    model is refused with the mismatching key)."""
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.exists(file):
        raise WeightLoadError(f"spec.draft_path={path!r} has no {CONFIG_FILE}")
    with open(file) as f:
        head_cfg = json.load(f)
    if head_cfg.get("architecture") != "NextNHead":
        raise WeightLoadError(f"spec.draft_path={path!r}: config.json is not a NextNHead")
    for key in _SHAPE_KEYS:
        if key in head_cfg and head_cfg[key] != getattr(cfg, key, None):
            raise WeightLoadError(f"spec.draft_path={path!r}: {key}={head_cfg[key]} but the "
                                  f"target has {getattr(cfg, key, None)}")
    return head_cfg


def load_head(path: str, cfg: Any, layer_id: int,
              target_lm_head: torch.Tensor | None = None) -> NextNHead:
    """Build the head in the current default dtype/device and load DIR/model.safetensors; a draft
    vocabulary in the file gathers its rows of `target_lm_head` [V, H] (required then)."""
    from safetensors.torch import load_file

    head_cfg = check_head_config(path, cfg)
    file = os.path.join(path, HEAD_FILE)
    if not os.path.exists(file):
        raise WeightLoadError(f"spec.draft_path={path!r} has no {HEAD_FILE}")
    head = NextNHead(cfg, layer_id)
    dtype = torch.get_default_dtype()
    tensors = load_file(file)
    head.tree_paths = paths_from_json(head_cfg.get("tree_paths"))
    vocab = tensors.pop(VOCAB_TENSOR, None)
    load_weights(head, ((name, t.to(dtype)) for name, t in tensors.items()))
    if vocab is not None:
        _check_vocab(path, vocab, head_cfg, cfg.vocab_size)
        if target_lm_head is None:
            raise WeightLoadError(f"spec.draft_path={path!r}: a draft vocabulary needs the "
                                  "target's LM head")
        head.use_vocab(vocab, target_lm_head)
    return head


def _check_vocab(path: str, vocab: torch.Tensor, head_cfg: dict, vocab_size: int) -> None:
    """Sorted, distinct ids inside the target's vocabulary, as many as config.json says."""
    v = vocab.to(torch.int64)
    size = head_cfg.get("draft_vocab_size", len(v))
    if (v.dim() != 1 or len(v) != size or not len(v) or int(v.min()) < 0
            or int(v.max()) >= vocab_size or not bool((v[1:] > v[:-1]).all())):
        raise WeightLoadError(f"spec.draft_path={path!r}: {VOCAB_TENSOR} must be {size} sorted "
                              f"distinct token ids below {vocab_size}")


def dummy_vocab_size(draft_path: str) -> int | None:
    """The draft vocabulary of `spec.draft_path=dummy[:D]` (None: not a dummy head; 0: every
    token). Plain `dummy` has the trainer's default D, so benchmarks time what a trained head
    costs; `dummy:0` scores the whole vocabulary."""
    name, _, size = draft_path.partition(":")
    if name != "dummy":
        return None
    if not size:
        return DEFAULT_SIZE
    if not size.isdigit():
        raise ConfigError("spec.draft_path", f"{draft_path!r}: dummy:D takes a draft vocabulary "
                                             "size D >= 0")
    return int(size)


def random_head(cfg: Any, layer_id: int, seed: int, vocab_size: int = 0,
                target_lm_head: torch.Tensor | None = None) -> NextNHead:
    """Random weights (model.load_format=dummy benchmarks): norms at 1, N(0, 0.02) elsewhere;
    with 0 < vocab_size < the target's, a draft vocabulary of the lowest `vocab_size` ids (rows
    of `target_lm_head`)."""
    head = NextNHead(cfg, layer_id)
    gen = torch.Generator(device=head.eh_proj.weight.device).manual_seed(seed + 1)
    for name, p in head.named_parameters():
        if "norm" in name:
            p.data.fill_(1.0)
        else:
            p.data.normal_(0.0, 0.02, generator=gen)
    if target_lm_head is not None and 0 < vocab_size < cfg.vocab_size:
        head.use_vocab(torch.arange(vocab_size), target_lm_head)
    return head
