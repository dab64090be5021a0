"""Programmatic dependent launch (PDL, Hopper and later) for the decode-path Triton kernels.

Why: a batch-1 decode step of a 48-layer MoE model is ~430 short kernels, each streaming a few
MB; between two of them the GPU drains the first grid, launches the second and ramps its loads
up again, with HBM idle meanwhile. With PDL the next kernel is launched while the current one
still runs (`launch_pdl=True`, captured into CUDA graphs as a programmatic edge): its programs
become resident, issue the loads that depend on nothing the previous kernel writes (weights),
and wait in `griddepcontrol.wait` until the previous grid has finished and flushed its memory.

The rule every kernel taking `USE_PDL` keeps: before `pdl_wait` it only reads parameters (model
weights, never written during a forward) and writes nothing; `pdl_wait` also lets the kernel
after it launch (`griddepcontrol.launch_dependents`), so at most one grid waits ahead of the
running one. Kernels launched without the flag, before or after, are ordered as usual; waiting
is transitive, so a kernel waiting on its predecessor also waits on everything before it.

Off on CPU (the interpreter has no griddepcontrol), before sm90, and where `model.pdl=false`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def pdl_supported(device: torch.device) -> bool:
    """PDL launches work here: a CUDA device of compute capability >= 9 and a Triton with the
    griddepcontrol intrinsics (3.4+)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    cuda = getattr(getattr(tl, "extra", None), "cuda", None)
    if cuda is None or not hasattr(cuda, "gdc_wait"):
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def launch_kwargs(pdl: bool) -> dict:
    """Extra keyword arguments of a kernel launch: PDL's launch flag and the kernel's USE_PDL."""
    return {"launch_pdl": True, "USE_PDL": True} if pdl else {"USE_PDL": False}


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """Wait for the previous grid's completion (and memory), then let the next grid launch."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
