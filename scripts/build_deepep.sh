#!/usr/bin/env bash
# Builds DeepEP from its source, in place, on a lent GPU machine (docs/architecture.md §11: tag
# v1.2.1, the Buffer API our adapter targets; nvcc 13, NVSHMEM from the image's nvidia.nvshmem
# package).
#   bash scripts/build_deepep.sh [SRC]   then PYTHONPATH=SRC python3 -c "import deep_ep" works
#   source scripts/build_deepep.sh        the same for SRC=${DEEPEP_SRC:-.deepep} (a sourced script
#                                         sees its caller's arguments: they are ignored), and
#                                         PYTHONPATH is exported in the calling shell
# SRC (default .deepep, git-ignored) holds the source; the GPU machine has no network, so it
# travels with the device call (carry: [".deepep"], about 2 MB). Bring it here once:
#   fetch github:deepseek-ai/DeepEP (a mirror), then
#   mkdir -p .deepep && git -C <mirror> archive v1.2.1 | tar -x -C .deepep
# The built extension is not kept between device calls (carry replaces the folder): build in the
# call that uses it (about a minute). Log: $OUT/deepep_build.log; on failure its key lines print.

_deepep_build() {
  local src=${1:-${DEEPEP_SRC:-.deepep}} out=${OUT:-/tmp/gpu_out} nvcc cuda_home cccl start rc
  mkdir -p "$out"
  if [ ! -f "$src/setup.py" ]; then
    echo "build_deepep: no DeepEP source in $src (see the header of scripts/build_deepep.sh)"
    return 1
  fi
  src=$(cd "$src" && pwd)
  cuda_home=${CUDA_HOME:-${CUDA_PATH:-}}
  if [ -z "$cuda_home" ]; then  # nvcc on PATH may be a wrapper script: prefer the usual root
    if [ -x /usr/local/cuda/bin/nvcc ]; then cuda_home=/usr/local/cuda
    else cuda_home=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")"); fi
  fi
  nvcc=$cuda_home/bin/nvcc
  cccl=$cuda_home/include/cccl  # CUDA 13 keeps cub/thrust/cuda:: headers here
  echo "build_deepep: $src with $("$nvcc" --version 2>/dev/null | tail -1), CUDA_HOME=$cuda_home"
  python3 -c "import torch, nvidia.nvshmem as n; print('torch', torch.__version__, 'cuda', \
torch.version.cuda, '| nvshmem', list(n.__path__)[0])" 2>&1 | tail -1
  start=$(date +%s)
  (
    cd "$src" || exit 1
    export CUDA_HOME=$cuda_home TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
    export MAX_JOBS=${MAX_JOBS:-$(nproc)}
    if [ -d "$cccl" ]; then
      export NVCC_APPEND_FLAGS="${NVCC_APPEND_FLAGS:+$NVCC_APPEND_FLAGS }-I$cccl"
      export CPLUS_INCLUDE_PATH="$cccl${CPLUS_INCLUDE_PATH:+:$CPLUS_INCLUDE_PATH}"
    fi
    python3 setup.py build_ext --inplace
  ) > "$out/deepep_build.log" 2>&1
  rc=$?
  if [ $rc -ne 0 ]; then
    echo "build_deepep: build failed (exit $rc) after $(( $(date +%s) - start )) s; key lines" \
      "of $out/deepep_build.log:"
    grep -n -i -E "error|fatal|undefined reference|cannot find|no such file" \
      "$out/deepep_build.log" | head -30
    tail -5 "$out/deepep_build.log"
    return 1
  fi
  if ! PYTHONPATH="$src${PYTHONPATH:+:$PYTHONPATH}" python3 -c "import deep_ep, deep_ep_cpp; \
print('build_deepep: deep_ep imports from', deep_ep.__file__)"; then
    echo "build_deepep: built, but deep_ep does not import (log: $out/deepep_build.log)"
    return 1
  fi
  echo "build_deepep: built in $(( $(date +%s) - start )) s"
  DEEPEP_DIR=$src
}

if [[ "${BASH_SOURCE[0]}" != "$0" ]]; then  # sourced: keep PYTHONPATH in the caller's shell
  _deepep_build "${DEEPEP_SRC:-.deepep}" \
    && export PYTHONPATH="$DEEPEP_DIR${PYTHONPATH:+:$PYTHONPATH}"
else
  _deepep_build "$@"
fi
