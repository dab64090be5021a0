"""Kernels, by what runs them: a file's folder says so.

- triton/: Triton kernels (CUDA, or Triton's interpreter on a CPU under TRITON_INTERPRET=1), each
  with its torch path beside it or in the layer that calls it. Callers import them behind a check
  (device, backend, or a guarded import), so an install without Triton runs the torch paths.
- cpu/: the C decode kernels (decode.c, linear.c), their ctypes wrapper (ops.py), the build with
  the system C compiler (build.py) and the run-time probe of a build (probe.py).
- here: torch code both sides share and adapters of outside libraries: DeepSeek's FP8 block
  format (fp8_format.py), per-expert counts (slot_counts.py), handing kernel objects to the
  modules that declare a slot for them (attach.py), and DeepGEMM's FP8 GEMM when installed
  (deepgemm_linear.py).
"""
