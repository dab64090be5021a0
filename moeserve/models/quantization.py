"""`model.quantization`: which weights stay resident in DeepSeek's block FP8, and loading them.

- `auto`: a checkpoint whose config.json carries an FP8 `quantization_config` keeps the weights
  it stores in e4m3 resident in FP8 on CUDA, in blocks of its `weight_block_size`; on CPU they
  are dequantized exactly at load. Other checkpoints load as they are.
- `fp8`: every eligible weight resident in FP8: e4m3 checkpoint tensors as stored, float ones
  (and dummy weights) quantized at load into 128 x 128 blocks (the checkpoint's block if it has
  one). On CPU too, where the layers run their torch reference (dequantize, then matmul).
- `none`: FP8 checkpoints dequantized at load (to the model dtype).

Eligible: the linear projections of the decoder layers (attention q / q_a / q_b / kv_a / o, MLA's
kv_b, dense MLPs, shared experts, the MTP eh_proj) and the routed experts. MLA's `kv_b_proj` is
never run as a linear: weight absorption uses it per head, as W_UK on the query and W_UV on the
attention output. The decode token's per-head GEMV reads its e4m3 bytes with the block scales
(kernels/triton/head_gemv.py: DeepSeek-V3's heads start on 128-row blocks), so FP8 halves a layer's
33.6 MB there too; more tokens run the einsum on a bf16 copy made at load
(`MLAttention.after_load`: resident, +16.8M elements a layer). Until 2026-12-04 it stayed bf16
only. Kept in higher precision:
- routers (`gate`, float32 in DeepSeek's checkpoints) and the score-correction bias: top-k
  choices flip on small errors, and they are tiny;
- the embedding (a row gather) and the LM head (the logits that sampling reads), which DeepSeek
  ships in bf16, unless `model.fp8_lm_head` (untied heads only): at decode batch 1 on a cut
  model it is the largest weight stream (docs/fp8.md); norms.
The conversion runs after the model is built and before loading: the routed experts (nearly all
of the bytes) are built in FP8 directly (`MoEParallel.fp8_block`); the other projections are
built in the model dtype and swapped one by one.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass

import torch
from torch import nn

from moeserve.config import ConfigError, ModelConfig
from moeserve.kernels.deepgemm_linear import deep_gemm_module
from moeserve.kernels.fp8_format import FP8_BLOCK, check_block
from moeserve.layers.fp8_linear import Fp8Linear, Fp8MergedLinear
from moeserve.layers.fp8_moe import Fp8MoEExperts
from moeserve.layers.linear import Linear, MergedLinear
from moeserve.layers.moe import DOWN
from moeserve.layers.moe_parallel import MoEParallel
from moeserve.models.loader import (checkpoint_files, fp8_target, iterate_weights,
                                    load_weights)

logger = logging.getLogger(__name__)

# module names (last component) kept in the model dtype even when eligible by place (see above)
HIGH_PRECISION_MODULES = ("gate",)
LAYER_PREFIX = "model.layers."
LM_HEAD = "lm_head"  # FP8 only with model.fp8_lm_head


def fp8_quantization_config(hf_config) -> dict | None:
    """config.json's FP8 quantization_config, or None; other methods are refused."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    method = qc.get("quant_method")
    if method != "fp8":
        raise ConfigError("model.quantization", f"checkpoint quant_method {method!r} is not "
                          "supported (only DeepSeek's block fp8)")
    if qc.get("activation_scheme", "dynamic") != "dynamic" or qc.get("fmt", "e4m3") != "e4m3":
        raise ConfigError("model.quantization", f"fp8 checkpoint {qc}: only e4m3 weights with "
                          "dynamic activation scales are supported")
    return qc


def checkpoint_fp8_weights(path: str) -> frozenset[str]:
    """Names of the weights a checkpoint stores in FP8 (those with a `weight_scale_inv`), read
    from the index or the safetensors headers."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            names = list(json.load(f)["weight_map"])
    else:
        from safetensors import safe_open

        names = []
        for file in checkpoint_files(path):
            with safe_open(file, framework="pt") as f:
                names += list(f.keys())
    suffix = ".weight_scale_inv"
    return frozenset(n[: -len(suffix)] + ".weight" for n in names if n.endswith(suffix))


@dataclass(frozen=True)
class QuantPlan:
    """What `model.quantization` resolved to for one model on one device."""

    fp8: bool = False  # FP8-resident modules
    block: tuple[int, int] = (FP8_BLOCK, FP8_BLOCK)
    backend: str = "torch"  # Fp8Linear forward: triton | deep_gemm (CUDA) | torch (reference)
    checkpoint_fp8: frozenset[str] | None = None  # auto: only these weights (None: all eligible)
    skip: tuple[str, ...] = ()  # quantization_config.modules_to_not_convert
    lm_head: bool = False  # model.fp8_lm_head: the (untied) LM head too, quantized at load

    def configure(self, par: MoEParallel) -> None:
        """Routed experts built in FP8 (before the model is constructed)."""
        par.fp8_block = self.block if self.fp8 and self._experts_fp8() else None

    def _experts_fp8(self) -> bool:
        return self.checkpoint_fp8 is None or any(".experts." in n for n in self.checkpoint_fp8)

    def convert(self, model: nn.Module) -> nn.Module:
        """Swap the eligible `Linear`s for FP8 ones (empty: loading fills them); returns model."""
        if not self.fp8:
            return model
        names = [n for n, m in model.named_modules()
                 if isinstance(m, Linear) and self._eligible(model, n)]
        for name in names:  # one at a time, so each float weight is freed before the next
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            setattr(parent, attr, self._fp8_linear(getattr(parent, attr)))
        experts = sum(isinstance(m, Fp8MoEExperts) for m in model.modules())
        logger.info("FP8 weights (e4m3, %dx%d blocks, %s GEMMs): %d linear layers%s, routed "
                    "experts of %d layers; routers, embedding, %snorms stay in higher "
                    "precision", *self.block, self.backend, len(names),
                    " (the LM head among them)" if LM_HEAD in names else "", experts,
                    "" if LM_HEAD in names else "LM head and ")
        return model

    def _eligible(self, model: nn.Module, name: str) -> bool:
        if name == LM_HEAD:
            return self.lm_head
        leaf = name.rpartition(".")[2]
        if not name.startswith(LAYER_PREFIX) or leaf in HIGH_PRECISION_MODULES:
            return False
        if any(s in name for s in self.skip):
            return False
        stored = self.checkpoint_fp8
        return stored is None or any(n in stored for n in checkpoint_names(model, name))

    def _fp8_linear(self, m: Linear) -> Fp8Linear:
        dev, bias = m.weight.device, m.bias is not None
        bias_dtype = m.bias.dtype if bias else None
        if isinstance(m, MergedLinear):
            shards = sorted(m.shards.items(), key=lambda kv: kv[1][0])
            return Fp8MergedLinear(m.in_features, [size for _, (_, size) in shards],
                                   [s for s, _ in shards], bias, self.block, self.backend,
                                   bias_dtype, dev)
        return Fp8Linear(m.in_features, m.out_features, bias, self.block, self.backend,
                         bias_dtype, dev)

    def load(self, model: nn.Module, path: str) -> None:
        """The checkpoint into `model`: FP8 tensors kept where the parameter is FP8."""
        keep = fp8_target(model, dict(model.named_parameters())) if self.fp8 else None
        load_weights(model, iterate_weights(path, keep_fp8=keep))

    @torch.no_grad()
    def init_dummy(self, model: nn.Module, seed: int, std: float = 0.02) -> None:
        """Random N(0, std) weights for the FP8 parameters, quantized through the loader (the
        float ones are the runner's `_init_dummy`)."""
        if not self.fp8:
            return
        gens: dict[torch.device, torch.Generator] = {}

        def tensors():
            for name, shape, device in dummy_fp8_tensors(model):
                gen = gens.setdefault(device, torch.Generator(device=device).manual_seed(seed))
                yield name, torch.empty(shape, device=device).normal_(0.0, std, generator=gen)

        load_weights(model, tensors(), strict=False)


def checkpoint_names(model: nn.Module, module_name: str) -> list[str]:
    """The checkpoint weights that load into a linear module (packed shards included)."""
    return list(_packed_parts(model, module_name))


def _packed_parts(model: nn.Module, module_name: str) -> dict[str, str | None]:
    """checkpoint weight name → the shard it fills (None: the module's own weight)."""
    parent, _, leaf = module_name.rpartition(".")
    parts = {f"{parent}.{ckpt}.weight": shard for ckpt, (param, shard)
             in getattr(model, "packed_modules_mapping", {}).items() if param == leaf}
    return parts or {f"{module_name}.weight": None}


def dummy_fp8_tensors(model: nn.Module):
    """(checkpoint name, float shape, device) of every tensor that fills an FP8 parameter."""
    proj = {shard: p for p, shard in getattr(model, "expert_weight_names", {}).items()}
    for name, m in model.named_modules():
        if isinstance(m, Fp8Linear):
            for ckpt, shard in _packed_parts(model, name).items():
                rows = m.out_features if shard is None else m.shards[shard][1]
                yield ckpt, (rows, m.in_features), m.weight.device
        elif isinstance(m, Fp8MoEExperts):
            h, i = m.w13.shape[2], m.intermediate_size
            for e in sorted(set(m.slot_logical)):
                for shard, p in proj.items():
                    shape = (h, i) if shard == DOWN else (i, h)
                    yield f"{name}.{e}.{p}.weight", shape, m.w13.device


def resolve_quant_plan(model_cfg: ModelConfig, hf_config, path: str,
                       device: torch.device) -> QuantPlan:
    """`model.quantization` for this checkpoint on this device (see the module docstring)."""
    mode = model_cfg.quantization
    qc = fp8_quantization_config(hf_config)
    if model_cfg.fp8_lm_head and getattr(hf_config, "tie_word_embeddings", False):
        raise ConfigError("model.fp8_lm_head", "this model's LM head is tied to its embedding, "
                          "which stays in the model dtype (a row gather)")
    if mode == "none" or (mode == "auto" and (qc is None or device.type != "cuda")):
        if model_cfg.fp8_lm_head:
            logger.info("model.fp8_lm_head ignored: the weights load in the model dtype here "
                        "(model.quantization=%s, %s)", mode, device.type)
        return QuantPlan()
    block = (FP8_BLOCK, FP8_BLOCK)
    if qc is not None and qc.get("weight_block_size"):
        try:
            block = check_block(tuple(qc["weight_block_size"]))
        except ValueError as e:
            raise ConfigError("model.quantization", f"quantization_config: {e}") from None
    skip = tuple(qc.get("modules_to_not_convert") or ()) if qc is not None else ()
    stored = None
    if mode == "auto" and model_cfg.load_format != "dummy":
        stored = checkpoint_fp8_weights(path)
    backend = "torch"
    if device.type == "cuda":
        backend = model_cfg.fp8_gemm  # triton | deep_gemm
        if backend == "deep_gemm" and deep_gemm_module() is None:
            raise ConfigError("model.fp8_gemm", "deep_gemm does not import here: install "
                              "DeepGEMM for this CUDA, or use model.fp8_gemm=triton")
    return QuantPlan(fp8=True, block=block, backend=backend, checkpoint_fp8=stored, skip=skip,
                     lm_head=model_cfg.fp8_lm_head)
