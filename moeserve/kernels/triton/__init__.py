"""Triton kernels: attention over the token-slot KV pool, fused MoE, FP8 GEMMs, small-M GEMVs,
the decode step's small ops (ops.py: TritonOps, the mirror of cpu/ops.py's CpuKernels), the p2p
EP row copies, and programmatic dependent launches (pdl.py). Tuned fused-MoE launch configs ship
in moe_configs/."""
