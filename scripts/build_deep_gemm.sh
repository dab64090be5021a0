#!/usr/bin/env bash
# Builds DeepGEMM's extension in place on a lent GPU machine, for `model.fp8_gemm=deep_gemm`
# (kernels/deepgemm_linear.py). The GPU image has no deep_gemm and no network; the package
# index's deep_gemm sdist lacks its CUDA headers. So bring the source here once:
#   fetch github:deepseek-ai/DeepGEMM, github:NVIDIA/cutlass and github:fmtlib/fmt (mirrors), then
#   git -C <DeepGEMM> archive HEAD | tar -x -C .dg, and into .dg/third-party/{cutlass,fmt} the
#   `include` folders of the commits `git -C <DeepGEMM> ls-tree HEAD third-party/` pins
#   (about 30 MB; carry: [".dg"]).
#   bash scripts/build_deep_gemm.sh [SRC]   then PYTHONPATH=SRC python3 -c "import deep_gemm"
# The extension is compiled by torch.utils.cpp_extension.load (the flags of DeepGEMM's setup.py,
# without its wheel/packaging steps); its kernels are JIT-compiled by nvcc when first called.
# Not kept between device calls (carry replaces the folder): build in the call that uses it.
set -u
src=${1:-${DEEP_GEMM_SRC:-.dg}}
out=${OUT:-/tmp/gpu_out}
mkdir -p "$out"
if [ ! -f "$src/csrc/python_api.cpp" ]; then
  echo "build_deep_gemm: no DeepGEMM source in $src (see this script's header)"; exit 1
fi
src=$(cd "$src" && pwd)
cuda_home=${CUDA_HOME:-${CUDA_PATH:-}}
if [ -z "$cuda_home" ]; then
  if [ -x /usr/local/cuda/bin/nvcc ]; then cuda_home=/usr/local/cuda
  else cuda_home=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")"); fi
fi
export CUDA_HOME=$cuda_home TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
# the JIT includes cute/ and cutlass/ from the package's own include folder
ln -sfn "$src/third-party/cutlass/include/cutlass" "$src/deep_gemm/include/cutlass"
ln -sfn "$src/third-party/cutlass/include/cute" "$src/deep_gemm/include/cute"
start=$(date +%s)
(cd "$src" && python3 - <<'EOF'
import ast, glob, os, re, shutil, torch
from torch.utils.cpp_extension import load

home = os.environ["CUDA_HOME"]
# the libraries its setup.py links (2.1.x adds the driver, `cuda`, which links from stubs/)
libs = ast.literal_eval(re.search(r"build_libraries = (\[.*?\])", open("setup.py").read()).group(1))
# the extension's name: "deep_gemm._C" (2.2 on) lives in the package, "deep_gemm_cpp" (2.1.x)
# is a top-level module beside it
full = re.search(r"CUDAExtension\(name=['\"]([\w.]+)['\"]", open("setup.py").read()).group(1)
pkg, _, name = full.rpartition(".")
build = os.path.abspath("build_jit")
os.makedirs(build, exist_ok=True)
load(name=name, sources=["csrc/python_api.cpp"], build_directory=build, verbose=False,
     extra_include_paths=[f"{home}/include", f"{home}/include/cccl", "deep_gemm/include",
                          "third-party/cutlass/include", "third-party/fmt/include"],
     extra_cflags=["-std=c++17", "-O3", "-Wno-psabi", "-Wno-deprecated-declarations"],
     extra_ldflags=[f"-L{home}/lib64", f"-L{home}/lib64/stubs"] + [f"-l{x}" for x in libs],
     is_python_module=True)
so = glob.glob(os.path.join(build, f"{name}*.so"))[0]
shutil.copy(so, os.path.join(pkg.replace(".", "/") or ".", os.path.basename(so)))
EOF
) > "$out/deep_gemm_build.log" 2>&1
rc=$?
echo "build_deep_gemm: rc $rc in $(( $(date +%s) - start )) s (log: deep_gemm_build.log)"
[ $rc = 0 ] || grep -E "error|Error" "$out/deep_gemm_build.log" | head -20
PYTHONPATH=$src${PYTHONPATH:+:$PYTHONPATH} python3 -c "import torch, deep_gemm; print('deep_gemm', \
deep_gemm.__version__, 'imports')" 2>&1 | tail -2
