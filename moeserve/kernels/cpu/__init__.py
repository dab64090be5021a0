"""The CPU decode kernels in C: sources (decode.c, linear.c, bf16.h), their ctypes wrapper
(ops.py: CpuKernels), the build with the system C compiler (build.py: load_cpu_kernels) and the
run-time probe that tries a build in a child process before it is used (probe.py)."""
