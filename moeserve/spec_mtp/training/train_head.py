"""The NextN draft head as the trainer builds it: transformers modules of the target's own family.

    o_i = norm(layer(eh_proj([enorm(embed(t_{i+1})) | hnorm(h_i)])))     logits_i = lm_head(o_i)

h_i is the target's post-norm final hidden state; logits_i predict t_{i+2}. `layer` is one
decoder layer of the target's class (LlamaDecoderLayer for SmolLM2), so this module and the
serving side's `spec_mtp/head.py` compute the same function from the same file. The embedding and
the LM head stay the target's: frozen here, absent from the file.

Training must see what serving feeds the head (EAGLE's observation): at serving time step 1 reads
the target's h at the last accepted position, and steps 2..N read the head's own previous output.
`chain` runs K such steps over every position of a sequence at once. Step k at position j
stands for a chain that started at p = j - k + 1: its query attends to the teacher-forced keys
of positions 0..p (what the serving side's draft KV holds after verification re-runs the head
over the accepted tokens) and to the keys of its own chain's steps 2..k at positions p+1..j.
"""

from __future__ import annotations

import copy
import inspect
import json
import os
from typing import Any

import torch
from torch import nn

HEAD_FILE, CONFIG_FILE = "model.safetensors", "config.json"
VOCAB_TENSOR = "draft_vocab"


class _ChainKV:
    """The minimal transformers Cache protocol: keys/values of earlier steps, concatenated."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def update(self, k: torch.Tensor, v: torch.Tensor, *args: Any, **kwargs: Any):
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)  # [B, kv_heads, S, D]
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v


def block_start(step: int, first: int, n: int) -> int:
    """First position chain step `step` computes: every position for step 1 (its keys are the
    teacher-forced context), else first + step - 1, the first position whose chain starts at or
    after `first` (earlier ones start in the prompt and count in no loss)."""
    return 0 if step == 1 else min(first + step - 1, n)


def chain_mask(n: int, step: int, dtype: torch.dtype, first: int = 0) -> torch.Tensor:
    """Additive mask [1, 1, n - a_step, n + sum_{s=2..step} (n - a_s)] for the queries of chain
    step `step` (1-based), a_s = block_start(s, first, n).

    Keys are laid out step-major: block 1 holds step 1's keys for positions 0..n-1, block s >= 2
    step s's keys for positions a_s..n-1. Query j (chain start p = j - step + 1 >= first) may see
    block 1 at positions <= p, and block s >= 2 only at position p + s - 1. Every query sees at
    least its own key, so no row is empty.
    """
    j = torch.arange(block_start(step, first, n), n).view(-1, 1)
    blocks = [torch.arange(n).view(1, n) <= j - step + 1]
    for s in range(2, step + 1):
        m = torch.arange(block_start(s, first, n), n).view(1, -1)
        blocks.append(m == j - step + s)
    allowed = torch.cat(blocks, dim=1)  # [queries, keys]
    mask = torch.zeros(allowed.shape, dtype=dtype)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask.view(1, 1, *allowed.shape)


class TrainHead(nn.Module):
    """enorm, hnorm, eh_proj [H, 2H], one decoder layer of the target's class, norm."""

    def __init__(self, target: nn.Module, init: str = "ridge"):
        """init: "ridge" (random layer, the target's final norm; `fit_eh_proj` then sets
        eh_proj), "random" (random layer, eh_proj [0 | I], unit norm) or "last_layer" (copies
        of the target's last layer and final norm, eh_proj [0 | I])."""
        super().__init__()
        cfg = target.config
        base = target.model
        h = cfg.hidden_size
        norm_cls, eps = type(base.norm), cfg.rms_norm_eps
        self.enorm, self.hnorm = norm_cls(h, eps=eps), norm_cls(h, eps=eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        if init not in ("ridge", "random", "last_layer"):
            raise ValueError(f"unknown init {init!r} (ridge | random | last_layer)")
        if init == "last_layer":
            self.layer = copy.deepcopy(base.layers[-1])
        else:
            self.layer = type(base.layers[-1])(cfg, layer_idx=0)
            self.layer.apply(target._init_weights)
        self.norm = norm_cls(h, eps=eps) if init == "random" else copy.deepcopy(base.norm)
        self.layer.self_attn.layer_idx = 0
        # eager attention (matmul + softmax) over the chain mask: its backward ran ~17% faster
        # per training step than SDPA's CPU flash kernel (SmolLM2, bf16 autocast); a copy of
        # the config, so the target keeps its own choice
        attn_cfg = copy.deepcopy(cfg)
        attn_cfg._attn_implementation = "eager"
        self.layer.self_attn.config = attn_cfg
        with torch.no_grad():  # [0 | I]: at init the layer reads the target's hidden state
            self.eh_proj.weight.zero_()
            self.eh_proj.weight[:, h:].copy_(torch.eye(h))
        self.rotary = type(base.rotary_emb)(config=cfg)
        self.vocab: torch.Tensor | None = None  # draft vocabulary (sorted ids), None: all
        self.requires_grad_(True)  # the copies inherit the frozen target's flags
        self._cache_kw = _cache_kwarg(self.layer)

    def step(self, e: torch.Tensor, hidden: torch.Tensor, mask: torch.Tensor, rope, kv: _ChainKV,
             positions: torch.Tensor) -> torch.Tensor:
        """One head application; e is enorm(embed) already. [B, n, H] -> [B, n, H]."""
        x = self.eh_proj(torch.cat([e, self.hnorm(hidden)], dim=-1))
        y = self.layer(x, attention_mask=mask, position_ids=positions, position_embeddings=rope,
                       **{self._cache_kw: kv})
        return self.norm(y[0] if isinstance(y, tuple) else y)

    def chain(self, embeds: torch.Tensor, hidden: torch.Tensor, steps: int,
              detach: bool = False, first: int = 0) -> list[torch.Tensor]:
        """Outputs [B, n, H] of chain steps 1..steps (see the module docstring): step 1 at every
        position, step k >= 2 at the positions whose chain starts at or after `first` (zeros
        before: on this CPU skipping the prompt's chains saves ~10% of a training step).

        embeds [B, n, H] = embed(t_{j+1}); hidden [B, n, H] = target h_j. Step k's hidden input at
        position j is step k-1's output at j-1; `detach` stops gradients through that feedback.
        """
        b, n, _ = embeds.shape
        positions = torch.arange(n, device=embeds.device).unsqueeze(0)
        cos, sin = self.rotary(embeds, positions)
        e = self.enorm(embeds)
        kv = _ChainKV()
        outs: list[torch.Tensor] = []
        h_in = hidden
        for k in range(1, steps + 1):
            a = block_start(k, first, n)
            mask = chain_mask(n, k, embeds.dtype, first).to(embeds.device)
            o = self.step(e[:, a:], h_in[:, a:], mask, (cos[:, a:], sin[:, a:]), kv,
                          positions[:, a:])
            if a:
                o = torch.cat([o.new_zeros(b, a, o.shape[-1]), o], dim=1)
            outs.append(o)
            prev = o.detach() if detach else o
            h_in = torch.cat([torch.zeros_like(prev[:, :1]), prev[:, :-1]], dim=1)  # shift right
        return outs

    def head_state_dict(self) -> dict[str, torch.Tensor]:
        """The file's tensors: the head's parameters only (the rotary buffer is derived)."""
        return {k: v.detach().contiguous() for k, v in self.named_parameters()}


@torch.no_grad()
def fit_eh_proj(head: TrainHead, target: nn.Module, records: list[dict[str, Any]],
                ridge: float = 1e-4) -> int:
    """Set eh_proj to the least-squares map from [enorm(e_j) | hnorm(h_j)] to the direction of
    the target's next hidden state h_{j+1} (divided by the head's final-norm weight, so that
    norm() of the projection alone reproduces h_{j+1}) over the answer positions of `records`.

    With the fresh layer's small residual updates this head already predicts t_{j+2}: on
    SmolLM2 the fit alone gave 0.34 held-out step-1 agreement, which SGD from the [0 | I] init
    took ~60 steps (~3 CPU minutes) to reach; the fit takes seconds. Returns the positions used.
    """
    from moeserve.spec_mtp.training.train_eval import collate

    embed = target.get_input_embeddings()
    w = head.norm.weight
    w = torch.where(w.abs() < 1e-2, torch.full_like(w, 1e-2), w)  # no division by ~0
    h = w.shape[0]
    xtx, xty, n = torch.zeros(2 * h, 2 * h), torch.zeros(2 * h, h), 0
    for i in range(0, len(records), 16):
        batch = collate(records[i: i + 16], embed)
        valid = batch.valid(1)
        x = torch.cat([head.enorm(batch.embeds[valid]), head.hnorm(batch.hidden[valid])], -1)
        y = batch.next_hidden[valid] / w
        xtx += x.T @ x  # [2H, 2H]
        xty += x.T @ y  # [2H, H]
        n += x.shape[0]
    sol = torch.linalg.solve(xtx + ridge * max(n, 1) * torch.eye(2 * h), xty)
    head.eh_proj.weight.copy_(sol.T)
    return n


def _cache_kwarg(layer: nn.Module) -> str:
    """transformers renamed the decoder layer's `past_key_values` argument to `cache` (5.x)."""
    params = inspect.signature(layer.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def head_config(target: nn.Module, meta: dict[str, Any]) -> dict[str, Any]:
    """DIR/config.json: what the serving side checks against its target, plus training facts."""
    cfg = target.config
    return {
        "architecture": "NextNHead",
        "target_architecture": (cfg.architectures or [type(target).__name__])[0],
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "intermediate_size": cfg.intermediate_size,
        "rms_norm_eps": cfg.rms_norm_eps,
        **meta,
    }


def save_head(head: TrainHead, target: nn.Module, out: str, meta: dict[str, Any],
              dtype: torch.dtype = torch.float32) -> None:
    """Write DIR/model.safetensors and DIR/config.json; tmp + rename so readers never see half."""
    from safetensors.torch import save_file

    os.makedirs(out, exist_ok=True)
    tensors = {k: v.to(dtype) for k, v in head.head_state_dict().items()}
    if head.vocab is not None:  # served by spec_mtp/head.py: gathers these LM head rows
        tensors[VOCAB_TENSOR] = head.vocab.to(torch.int64).contiguous()
        meta = meta | {"draft_vocab_size": len(head.vocab)}
    tmp = os.path.join(out, HEAD_FILE + ".tmp")
    save_file(tensors, tmp, metadata={"format": "pt"})
    os.replace(tmp, os.path.join(out, HEAD_FILE))
    with open(os.path.join(out, CONFIG_FILE), "w") as f:
        json.dump(head_config(target, meta), f, indent=2)


def write_tree_paths(out: str, paths: list[list], topk: int) -> None:
    """Record the eval's rank path counts in DIR/config.json (`tree_paths`, `tree_paths_topk`):
    serving picks a pruned draft tree's nodes from them (spec.num_draft_tokens)."""
    file = os.path.join(out, CONFIG_FILE)
    with open(file) as f:
        cfg = json.load(f)
    cfg["tree_paths"], cfg["tree_paths_topk"] = paths, topk
    with open(file + ".tmp", "w") as f:
        json.dump(cfg, f, indent=2)
    os.replace(file + ".tmp", file)


def load_head(path: str, target: nn.Module) -> tuple[TrainHead, dict[str, Any]]:
    """A TrainHead with DIR's weights (float32) and DIR's config.json, checked against target."""
    from safetensors.torch import load_file

    with open(os.path.join(path, CONFIG_FILE)) as f:
        cfg = json.load(f)
    if cfg.get("architecture") != "NextNHead":
        raise ValueError(f"{path}: config.json is not a NextNHead")
    expected = head_config(target, {})
    for key in ("target_architecture", "hidden_size", "vocab_size", "num_key_value_heads"):
        if cfg.get(key) != expected[key]:
            raise ValueError(f"{path}: {key}={cfg.get(key)} but the target has {expected[key]}")
    head = TrainHead(target)
    tensors = load_file(os.path.join(path, HEAD_FILE))
    if VOCAB_TENSOR in tensors:
        head.vocab = tensors.pop(VOCAB_TENSOR).to(torch.int64)
    tensors = {k: v.float() for k, v in tensors.items()}
    head.load_state_dict(tensors, strict=False)
    missing = set(head.head_state_dict()) ^ set(tensors)
    if missing:
        raise ValueError(f"{path}: tensor names differ from the head's: {sorted(missing)[:4]}")
    return head, cfg
