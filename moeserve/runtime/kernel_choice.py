"""Which kernels a runner uses: attention backend, routed-expert backend, CUDA graphs.

`auto` is resolved here, once, from the device and what is available; an explicit choice that
cannot work is refused with the config key in the message (never silently replaced).
"""

from __future__ import annotations

import torch

from moeserve.config import ConfigError, MoeserveConfig


def _triton_usable(device: torch.device, interpret: bool) -> bool:
    """Triton kernels run on CUDA, and on CPU tensors only in Triton's interpreter."""
    return device.type == "cuda" or interpret


def attention_backend_name(cfg: MoeserveConfig, device: torch.device, has_cpu_kernels: bool,
                           interpret: bool) -> str:
    name = cfg.attention.backend
    if name == "auto":
        if device.type == "cuda":
            return "triton"
        return "cpu" if has_cpu_kernels else "torch"
    if name == "triton" and not _triton_usable(device, interpret):
        raise ConfigError("attention.backend", "triton needs a CUDA device (or TRITON_INTERPRET=1 "
                          "to run its kernels in Triton's interpreter on CPU)")
    if name == "cpu" and not has_cpu_kernels:
        raise ConfigError("attention.backend", f"cpu: the CPU kernels are not available here "
                          f"(device {device}, or no C compiler: see the log)")
    return name


def moe_backend_name(cfg: MoeserveConfig, device: torch.device, interpret: bool) -> str:
    name = cfg.moe.backend
    if name == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if name == "triton" and not _triton_usable(device, interpret):
        raise ConfigError("moe.backend", "triton needs a CUDA device (or TRITON_INTERPRET=1 to run "
                          "its kernels in Triton's interpreter on CPU)")
    return name


def use_pdl(cfg: MoeserveConfig, device: torch.device) -> bool:
    """model.pdl resolved: None is on where the device supports programmatic dependent launch
    (kernels/triton/pdl.py); true where it does not is refused."""
    if cfg.model.pdl is False or device.type != "cuda":
        return False
    from moeserve.kernels.triton.pdl import pdl_supported

    ok = pdl_supported(device)
    if cfg.model.pdl and not ok:
        raise ConfigError("model.pdl", "programmatic dependent launch needs an sm90+ GPU and "
                          "Triton >= 3.4 (tl.extra.cuda.gdc_wait)")
    return ok


def use_cuda_graphs(cfg: MoeserveConfig, device: torch.device, attention_graph_safe: bool,
                    dispatcher) -> tuple[bool, str]:
    """(on, why): on CUDA by default where the decode step can be captured; an explicit
    cuda_graph.enabled=true that cannot be honoured is refused."""
    wanted = cfg.cuda_graph.enabled
    if wanted is False:
        return False, "cuda_graph.enabled=false"
    blockers = []
    if device.type != "cuda":
        blockers.append(f"device is {device.type}")
    if not attention_graph_safe:
        blockers.append(f"attention.backend={cfg.attention.backend} syncs with the host in decode")
    if dispatcher is not None and not getattr(dispatcher, "graph_safe", False):
        blockers.append(f"parallel.a2a_backend={cfg.parallel.a2a_backend} sizes its transfers "
                        "on the host")
    if blockers and wanted:
        raise ConfigError("cuda_graph.enabled", "CUDA graphs cannot be used: " + "; ".join(blockers))
    return (False, "; ".join(blockers)) if blockers else (True, "")
