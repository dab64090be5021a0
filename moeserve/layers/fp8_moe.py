"""Routed experts resident in DeepSeek's block FP8: e4m3 stacks with float32 block scales.

    w13 [E_local, 2I, H] e4m3, w13_scale_inv [E_local, 2 * ceil(I/bn), ceil(H/bk)]  (gate, then up)
    w2  [E_local, H, I]  e4m3, w2_scale_inv  [E_local, ceil(H/bn), ceil(I/bk)]

Gate and up are blocked separately (each checkpoint tensor has its own `weight_scale_inv`), so a
partial last block of gate never shares a scale with up's first rows. Forward: the fused-MoE
Triton kernels' FP8 variant (activations quantized per token and bk channels, EP-local masking as
in bf16; at <= SMALL_MAX_PAIRS pairs fused_moe's GEMV kernels, weight-only: x and the
intermediate stay in x.dtype), or the torch reference that dequantizes the experts that received
tokens, or (`backend="emulate"`) the Triton path's arithmetic in float64 (layers/fp8_emulation.py).
"""

from __future__ import annotations

import torch
from torch import nn

from moeserve.kernels.fp8_format import FP8_BLOCK, Block, check_block, dequantize_fp8_blocks
from moeserve.layers.activation import silu_and_mul
from moeserve.layers.fp8_linear import Fp8Linear, fp8_parameter, scale_parameter
from moeserve.layers.moe import DOWN, GATE, UP, MoEExperts


class Fp8MoEExperts(MoEExperts):
    """MoEExperts with FP8 weights (same slots, loading and routing contract)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 block: int | Block = FP8_BLOCK, **kwargs):
        # NOTE: a plain attribute before Module.__init__: create_weights (called from the base
        # constructor) needs it
        self.block = check_block(block)
        super().__init__(num_experts, hidden_size, intermediate_size, **kwargs)

    def create_weights(self, hidden_size: int, intermediate_size: int) -> None:
        bn, bk = self.block
        e, i, h = self.num_local, intermediate_size, hidden_size
        self.w13 = fp8_parameter(e, 2 * i, h)
        self.w2 = fp8_parameter(e, h, i)
        self.w13_scale_inv = scale_parameter(e, 2 * -(-i // bn), -(-h // bk))
        self.w2_scale_inv = scale_parameter(e, -(-h // bn), -(-i // bk))
        self.expect_shards(self.w13, self.w2)
        self.expect_shards(self.w13_scale_inv, self.w2_scale_inv)
        for p in self.expert_params():
            p.fp8_block = self.block

    @property
    def gate_scale_rows(self) -> int:
        return self.w13_scale_inv.shape[1] // 2

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, expert_id: int,
                      shard: str) -> None:
        """FP8 weights load as in MoEExperts; scales into gate's rows, up's rows or down's."""
        if param is self.w13 or param is self.w2:
            return super().weight_loader(param, loaded, expert_id, shard)
        g = self.gate_scale_rows
        for local, logical in enumerate(self.slot_logical):
            if logical != expert_id:
                continue
            dest = {GATE: param.data[local, :g], UP: param.data[local, g:],
                    DOWN: param.data[local]}[shard]
            if dest.shape != loaded.shape:
                raise ValueError(f"expert {expert_id} {shard} scales: expected "
                                 f"{tuple(dest.shape)}, got {tuple(loaded.shape)}")
            dest.copy_(loaded)

    def expert_params(self) -> list[nn.Parameter]:
        return [self.w13, self.w2, self.w13_scale_inv, self.w2_scale_inv]

    def expert_weights(self, local: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Local slot `local` dequantized: (w13 [2I, H], w2 [H, I]) float32."""
        i, g = self.intermediate_size, self.gate_scale_rows
        w13, s13 = self.w13[local], self.w13_scale_inv[local]
        gate = dequantize_fp8_blocks(w13[:i], s13[:g], self.block)
        up = dequantize_fp8_blocks(w13[i:], s13[g:], self.block)
        w2 = dequantize_fp8_blocks(self.w2[local], self.w2_scale_inv[local], self.block)
        return torch.cat([gate, up]), w2

    def stacked_weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        pairs = [self.expert_weights(e) for e in range(self.num_local)]
        return (torch.stack([a for a, _ in pairs]).to(dtype),
                torch.stack([b for _, b in pairs]).to(dtype))

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
        """x: [T, H]; topk_ids/weights: [T, K] (global ids; non-local ids contribute 0)."""
        if self.backend == "triton":
            return self.forward_triton(x, topk_ids, topk_weights)
        if self.backend == "emulate":  # the triton path's arithmetic in float64
            from moeserve.layers.fp8_emulation import emulate_fp8_moe

            return emulate_fp8_moe(self, x, topk_ids, topk_weights)
        return self.forward_reference(x, topk_ids, topk_weights)

    def forward_per_expert(self, x: torch.Tensor) -> torch.Tensor:
        """The low-latency layout [E_local, M, H] through the FP8 fused MoE (every row routed to
        its block's expert with weight 1); the torch path dequantizes every local expert."""
        if self.backend != "triton":
            return super().forward_per_expert(x)
        e, m, h = x.shape
        ids = torch.arange(self.first_expert, self.first_expert + e, device=x.device)
        ids = ids.repeat_interleave(m)[:, None]  # [E*M, 1]
        ones = torch.ones(e * m, 1, dtype=torch.float32, device=x.device)
        return self.forward_triton(x.reshape(e * m, h), ids, ones).view(e, m, h)

    def forward_triton(self, x: torch.Tensor, topk_ids: torch.Tensor,
                       topk_weights: torch.Tensor) -> torch.Tensor:
        from moeserve.kernels.triton.fused_moe import fused_moe
        from moeserve.kernels.triton.moe_config import get_moe_config

        cfg = get_moe_config(self.num_local, x.shape[1], self.intermediate_size,
                             topk_ids.shape[1], x.dtype, x.shape[0], self.config_dir)
        return fused_moe(x, self.w13, self.w2, topk_ids, topk_weights, self.first_expert,
                         self.num_local, cfg, self.w13_scale_inv, self.w2_scale_inv, self.block,
                         pdl=self.pdl)

    def forward_reference(self, x: torch.Tensor, topk_ids: torch.Tensor,
                          topk_weights: torch.Tensor, masked: bool | None = None) -> torch.Tensor:
        """The experts dequantized one at a time, in x's dtype. On CPU (`masked` False) each
        expert that received tokens runs on its tokens (host syncs); on CUDA every local expert
        runs on every token, weighted by its routing weight or 0, so that CUDA graphs can
        capture it (a reference: E_local times the FLOPs)."""
        out = torch.zeros_like(x, dtype=torch.float32)
        local = topk_ids - self.first_expert  # [T, K]
        masked = x.is_cuda if masked is None else masked
        if masked:
            experts = range(self.num_local)
        else:
            experts = local[(local >= 0) & (local < self.num_local)].unique().tolist()
        for e in experts:
            w13, w2 = (w.to(x.dtype) for w in self.expert_weights(e))
            if masked:
                weight = torch.where(local == e, topk_weights.float(), 0.0).sum(1)  # [T]
                out += (silu_and_mul(x @ w13.t()) @ w2.t()).float() * weight[:, None]
                continue
            tok, j = (local == e).nonzero(as_tuple=True)
            h = silu_and_mul(x[tok] @ w13.t()) @ w2.t()  # [n, H]
            out.index_add_(0, tok, h.float() * topk_weights[tok, j, None].float())
        return out.to(x.dtype)


def set_fp8_backend(model: torch.nn.Module, backend: str) -> int:
    """Every FP8 linear and FP8 expert module of `model` onto `backend` (triton | torch |
    emulate); returns how many modules."""
    mods = [m for m in model.modules() if isinstance(m, (Fp8Linear, Fp8MoEExperts))]
    for m in mods:
        m.backend = backend
    return len(mods)
