"""The draft model of NextN speculation: DeepSeek's MTP layer, or a trained NextNHead.

The model runner's one door into speculation: `build_draft` gives it the Draft (or None), whose
`extra_kv_layers` it sizes the KV pool by and whose `capture_graphs` it calls once its own CUDA
graphs are captured; the runner names no other spec_mtp module.

Both read the embedding of the token after position i and a hidden state for position i (the
target's at accepted positions, the draft's own while chaining), run one decoder block over their
own KV layer (the pool holds it next to the target's layers, at the same slots), and share the
target's embedding and LM head (a head with a draft vocabulary scores only those rows of it:
`logits` are then over its D tokens and `tokens` maps the argmax back to token ids).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from moeserve.config import ConfigError, MoeserveConfig
from moeserve.forward_batch import ForwardBatch
from moeserve.layers.fp8_linear import Fp8Linear
from moeserve.runtime.cuda_graph import GraphHost
from moeserve.runtime.sampler import greedy
from moeserve.spec_mtp.draft_graphs import DraftGraphRunner


class Draft:
    def __init__(self, module: nn.Module, target: nn.Module, extra_kv_layers: int, kind: str):
        self.module, self.target = module, target
        self.extra_kv_layers = extra_kv_layers  # KV layers the pool must add for the draft
        self.kind = kind  # "mtp" (the checkpoint's layer) | "head" (spec.draft_path)
        self.vocab: torch.Tensor | None = getattr(module, "vocab", None)  # [D] token ids
        self.lm_head: nn.Module | None = getattr(module, "lm_head", None)  # rows of `vocab`
        # a trained head's rank path counts (config.json `tree_paths`): pruned trees' nodes
        self.tree_paths: dict[tuple[int, ...], float] | None = getattr(module, "tree_paths", None)

    def forward(self, fb: ForwardBatch, input_ids: torch.Tensor,
                hidden: torch.Tensor) -> torch.Tensor:
        """Draft hidden states [T, H] for fb's geometry (positions, slots, sequence lengths)."""
        embeds = self.target.model.embed_tokens(input_ids)
        return self.module(embeds, hidden.to(embeds.dtype), fb.positions, fb)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, H] → [T, V], or [T, D] over the draft vocabulary."""
        if self.lm_head is not None:
            return self.lm_head(hidden)
        return self.target.compute_logits(hidden)

    def tokens(self, logits: torch.Tensor) -> torch.Tensor:
        """The drafted token ids [T] (int64) of `logits` from `logits()`: the argmax, mapped
        back through the draft vocabulary."""
        idx = greedy(logits)
        return idx if self.vocab is None else self.vocab[idx]

    def topk_tokens(self, logits: torch.Tensor, k: int) -> torch.Tensor:
        """The k best drafted token ids [T, k] (distinct, best first) of `logits()`."""
        idx = logits.topk(k, dim=-1).indices
        return idx if self.vocab is None else self.vocab[idx]

    def capture_graphs(self, host: GraphHost, max_bs: int) -> DraftGraphRunner:
        """CUDA graphs of this draft's decode-shaped passes up to max_bs rows, captured now
        (draft_graphs.py), for the runner `host` whose KV memory and backend they use."""
        graphs = DraftGraphRunner(host, self, max_bs)
        graphs.capture()
        return graphs


def build_draft(cfg: MoeserveConfig, model: nn.Module, hf_config: Any) -> Draft | None:
    """The draft for spec.algorithm=nextn (None when off). Call under the model's default dtype
    and device; a trained head becomes the submodule `nextn_head` so that CPU packing and GPU
    kernels reach it like any other layer."""
    spec = cfg.spec
    if spec.algorithm != "nextn":
        return None
    if spec.draft_path is None:
        if not getattr(model, "load_mtp", False):
            raise ConfigError("spec.draft_path", "this model has no NextN (MTP) layer in its "
                              "checkpoint: train a head with `python -m "
                              "moeserve.spec_mtp.training` and pass spec.draft_path=DIR")
        return Draft(model.mtp, model, 0, "mtp")
    from moeserve.spec_mtp.head import dummy_vocab_size, load_head, random_head

    layer_id = hf_config.num_hidden_layers
    rows = model.lm_head.weight  # a draft vocabulary gathers these
    if isinstance(model.lm_head, Fp8Linear):  # model.fp8_lm_head: the rows as they act
        rows = model.lm_head.dequantized().to(model.model.embed_tokens.weight.dtype)
    dummy = dummy_vocab_size(spec.draft_path)
    head = (load_head(spec.draft_path, hf_config, layer_id, rows) if dummy is None
            else random_head(hf_config, layer_id, cfg.seed, dummy, rows))
    model.add_module("nextn_head", head)
    return Draft(head, model, 1, "head")
