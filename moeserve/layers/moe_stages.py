"""The stages of one MoE layer: router ids to physical slots → dispatch start | dispatch wait →
this rank's experts → combine start | combine wait (| = where two-batch overlap may switch
micro-batches). `run_routed_experts` runs them straight through (the plain forward);
`moe_operations` declares them as a layer's op list for tbo/operations.py's executor. Each stage
reads and writes one MoEStepState, so the two micro-batches of a TBO step never share one.
"""

from __future__ import annotations

from typing import Any

import torch

from moeserve.layers.moe import MoEExperts
from moeserve.layers.moe_parallel import MoEParallel
from moeserve.tbo.operations import YIELD, MoEStepState, Op


def run_routed_experts(experts: MoEExperts, x: torch.Tensor, topk_ids: torch.Tensor,
                       topk_weights: torch.Tensor, par: MoEParallel | None, fb: Any = None,
                       layer_id: int = 0) -> torch.Tensor:
    """sum_k w[t,k] * expert_{ids[t,k]}(x[t]) over all experts, wherever they live: [T, H].
    `topk_ids` are logical; `fb` (the ForwardBatch, None outside a served step) carries the step's
    global forward mode (DeepEP picks kernels by it) and every rank's token count. The stages below
    run straight through; two-batch overlap runs the same stages from a layer's op list."""
    st = MoEStepState(x=x, topk_weights=topk_weights)
    st.topk_ids = to_slots(par, topk_ids, layer_id)
    moe_dispatch_start(par, st, fb)
    moe_dispatch_wait(par, st)
    moe_experts(experts, par, st)
    moe_combine_start(par, st)
    moe_combine_wait(par, st)
    return st.routed


# ---- the stages of one MoE layer (each reads and writes a MoEStepState) ----------------------------
def to_slots(par: MoEParallel | None, topk_ids: torch.Tensor, layer_id: int) -> torch.Tensor:
    """Logical router ids → physical slots [T, K], counted by the EPLB recorder (once per token:
    each micro-batch records its own tokens)."""
    if par is not None and par.location is not None:
        topk_ids = par.location.to_physical(topk_ids, layer_id)  # [T, K] physical slots
    if par is not None:
        par.recorder.record(layer_id, topk_ids)
    return topk_ids


def _dispatcher(par: MoEParallel | None) -> Any:
    return None if par is None else par.dispatcher


def moe_dispatch_start(par: MoEParallel | None, st: MoEStepState, fb: Any) -> None:
    """Launch the dispatch (collective); without a dispatcher every expert is local. A TBO
    micro-batch's dispatch is `overlapped` (the other one computes meanwhile)."""
    d = _dispatcher(par)
    if d is not None:
        mode = fb.global_forward_mode if fb is not None else None
        st.dispatch = d.dispatch_start(st.x, st.topk_ids, st.topk_weights, mode,
                                       fb.global_num_tokens if fb is not None else None,
                                       overlapped=fb is not None and fb.micro_batch)


def moe_dispatch_wait(par: MoEParallel | None, st: MoEStepState) -> None:
    d = _dispatcher(par)
    if d is not None:
        st.dispatched, st.dispatch = d.dispatch_wait(st.dispatch), None


def moe_experts(experts: MoEExperts, par: MoEParallel | None, st: MoEStepState) -> None:
    """This rank's experts on what arrived (or on the local tokens without a dispatcher)."""
    d = _dispatcher(par)
    if d is None:
        st.routed = experts(st.x, st.topk_ids, st.topk_weights)
    else:
        st.expert_out = d.experts_forward(experts, st.dispatched)


def moe_combine_start(par: MoEParallel | None, st: MoEStepState) -> None:
    d = _dispatcher(par)
    if d is not None:
        st.combine = d.combine_start(st.expert_out, st.dispatched)
        st.expert_out = None


def moe_combine_wait(par: MoEParallel | None, st: MoEStepState) -> None:
    d = _dispatcher(par)
    if d is not None:
        st.routed, st.combine, st.dispatched = d.combine_wait(st.combine), None, None


def moe_operations(block: Any, layer_id: int) -> list:
    """A MoE block (with `route`, `shared`, `experts`, `parallel`) as ops: router → dispatch start
    | dispatch wait → experts → combine start | combine wait → shared experts. Reads s.hidden
    (the normed post-attention stream); leaves s.moe.routed and s.moe.shared."""

    def router(s) -> None:
        weights, ids = block.route(s.hidden)  # [T, K] each
        s.moe = MoEStepState(x=s.hidden, topk_weights=weights,
                             topk_ids=to_slots(block.parallel, ids, block.layer_id))

    def stage(fn):
        return lambda s: fn(block.parallel, s.moe)

    def shared_experts(s) -> None:
        s.moe.shared = block.shared(s.moe.x)

    return [Op("router", router, layer_id),
            Op("dispatch_start", lambda s: moe_dispatch_start(block.parallel, s.moe, s.fb),
               layer_id), YIELD,
            Op("dispatch_wait", stage(moe_dispatch_wait), layer_id),
            Op("experts", lambda s: moe_experts(block.experts, block.parallel, s.moe), layer_id),
            Op("combine_start", stage(moe_combine_start), layer_id), YIELD,
            Op("combine_wait", stage(moe_combine_wait), layer_id),
            Op("shared_experts", shared_experts, layer_id)]
