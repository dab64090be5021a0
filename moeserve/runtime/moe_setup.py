"""A runner's MoE parallel state: expert placement (EPLB location), the expert-load recorder and
the EP dispatcher, built from the config and the rank's mesh before the model is."""

from __future__ import annotations

import torch

from moeserve.config import MoeserveConfig, loads_mtp_layer
from moeserve.distributed import ParallelMesh
from moeserve.layers.moe_parallel import ExpertRecorder, MoEParallel


def num_logical_experts(hf_config) -> int | None:
    """Routed experts of the checkpoint (None: a dense model)."""
    c = hf_config
    return (getattr(c, "n_routed_experts", None) or getattr(c, "num_experts", None)
            or getattr(c, "num_local_experts", None))


def build_moe_parallel(cfg: MoeserveConfig, mesh: ParallelMesh, hf_config, dtype: torch.dtype,
                       moe_backend: str, recorder: ExpertRecorder | None = None) -> MoEParallel:
    """MoEParallel for this rank; for MoE models with its location, recorder (the given one, else
    a new ExpertDistributionRecorder) and, with EP, the dispatcher."""
    par = MoEParallel(ep_rank=mesh.ep_rank, ep_size=mesh.ep_size, moe_backend=moe_backend,
                      moe_config_dir=cfg.moe.config_dir)
    num_logical = num_logical_experts(hf_config)
    if not num_logical:
        return par
    layers = hf_config.num_hidden_layers + int(loads_mtp_layer(cfg))
    par.location = expert_location(cfg, mesh, layers, num_logical)
    par.recorder = recorder or make_recorder(cfg, par, layers, num_logical, mesh.device)
    if mesh.ep_size > 1:
        par.dispatcher = make_dispatcher(cfg, mesh, par.num_physical(num_logical), hf_config,
                                         dtype)
    return par


def make_dispatcher(cfg: MoeserveConfig, mesh: ParallelMesh, num_physical: int, hf_config,
                    dtype: torch.dtype):
    """The `parallel.a2a_backend` dispatcher over the mesh's EP group (also rebuilt by elastic EP
    for a new group)."""
    from moeserve.ep.dispatcher import create_dispatcher

    return create_dispatcher(
        cfg.parallel.a2a_backend, mesh, num_physical, hf_config.hidden_size, dtype,
        deepep_mode=cfg.parallel.deepep_mode,
        max_dispatch_tokens_per_rank=low_latency_max_tokens(cfg),
        max_tokens_per_rank=max(cfg.scheduler.chunked_prefill_size,
                                cfg.cache.max_running_requests))


def low_latency_max_tokens(cfg: MoeserveConfig) -> int:
    """Tokens one rank may send in a DeepEP low-latency (decode) step: the largest decode batch,
    running requests or a captured graph's bucket, rounded up to a multiple of 4 (its TMA
    kernels want ranks x this divisible by 4). The default of 128 made batches above it fail."""
    most = max(cfg.cache.max_running_requests, cfg.cuda_graph.max_bs)
    return -(-most // 4) * 4


def make_recorder(cfg: MoeserveConfig, par: MoEParallel, layers: int, num_logical: int,
                  device: torch.device):
    """Per-physical-expert token counts on the device; records only once started (at load
    when eplb.record_mode is set, else through the expert_record_* control ops)."""
    from moeserve.eplb.recorder import ExpertDistributionRecorder

    e = cfg.eplb
    rec = ExpertDistributionRecorder(
        layers, par.num_physical(num_logical), "stat" if e.record_mode == "off" else
        e.record_mode, e.record_window, par.location, device=device)
    if e.record_mode != "off":
        rec.start()
    return rec


def expert_location(cfg: MoeserveConfig, mesh: ParallelMesh, layers: int, num_logical: int):
    """The expert placement (None = identity: no redundant experts, no placement file)."""
    e = cfg.eplb
    if e.num_redundant_experts == 0 and e.init_placement is None:
        return None
    from moeserve.eplb.location import ExpertLocation
    from moeserve.eplb.recorder import load_init_placement

    nodes, rank = cfg.parallel.nnodes, mesh.ep_rank
    if e.init_placement is not None:
        loc = load_init_placement(e.init_placement, mesh.ep_size, num_nodes=nodes,
                                  num_redundant=e.num_redundant_experts, ep_rank=rank,
                                  device=mesh.device)
    else:
        loc = ExpertLocation.trivial(layers, num_logical, mesh.ep_size,
                                     e.num_redundant_experts, nodes, rank, mesh.device)
    if loc.num_layers < layers or loc.num_logical != num_logical:
        raise ValueError(f"eplb.init_placement: placement has {loc.num_layers} layers x "
                         f"{loc.num_logical} experts, the model needs {layers} x {num_logical}")
    return loc
