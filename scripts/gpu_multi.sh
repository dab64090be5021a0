#!/usr/bin/env bash
# Issue 17's multi-GPU runs, one device call each (2-4 H200; called by scripts/gpu_check.sh MODE,
# which installs .whl/ and sets PYTHONPATH first). Logs and tables under $OUT. N = the GPUs seen.
#   deepep        build DeepEP v1.2.1 from .deepep/ (carry it: scripts/build_deepep.sh), then
#                 bench.ep (raw NCCL, p2p, deepep-normal, deepep-low_latency at 128-4096
#                 tokens/rank, hidden 7168 bf16, 256 experts top-8; low-latency rows up to 256),
#                 the adapter's dispatcher checks on the real package (tests/ep/test_deepep_real.py:
#                 normal / low_latency / auto at 2 and N ranks), and greedy dpN x epN with
#                 deepep (mode auto) vs p2p vs one GPU on tiny bf16 models of hidden 2048
#                 (scripts/gpu_dp_check.py). DEEPEP_BENCH / DEEPEP_TESTS / DEEPEP_DP=0 skip a step;
#                 DEEPEP_TEST_ARGS add pytest arguments (e.g. "-k 4").
#   tbo_ep        DeepSeek-V3 shape cut to DSV3_LAYERS (7: 3 dense + 4 MoE; dummy bf16) at dpN x epN
#                 (TBO_RANKS, TBO_BACKEND=p2p), TBO off vs on: prefill (8 x 1024-token prompts per
#                 rank) and decode at 256 requests per rank (bench.tbo --device cuda).
#   dpep_serving  per model of DPEP_MODELS (qwen3_30b_a3b: full 48 layers; dsv3: the cut above),
#                 one server per variant of DPEP_VARIANTS: dpep (dpN x epN = conf/parallel/
#                 dp4_ep4.yaml on 4 GPUs, CUDA graphs), dp (dpN, ep_size=1: every rank holds all
#                 experts; where it fits), one (one GPU); bench.serving at DPEP_CONC (256 1024)
#                 concurrent, 256 -> 128 tokens. Then (DPEP_IDENTITY=1) greedy outputs of tiny
#                 DeepSeek-V3 and Qwen3-MoE at dpN x epN (CUDA graphs) vs one GPU
#                 (gpu_dp_check.py). The 600 s device limit fits one model per call:
#                 DPEP_MODELS=qwen3_30b_a3b DPEP_IDENTITY=0, DPEP_MODELS=dsv3 DPEP_IDENTITY=0,
#                 then DPEP_MODELS= (empty: no model) for the identity check alone.
#   eplb_skew     decode under the Zipf(EPLB_ZIPF=1.2) router hook at dpN x epN on the cut
#                 DeepSeek-V3: no EPLB, EPLB from the recorded dump, +8 and +16 redundant experts;
#                 balancedness and tok/s side by side (bench.eplb_skew; dumps in $OUT/eplb_dumps).
# DRY_RUN=1 prints each command instead of running it (no GPU needed; N = DRY_RUN_GPUS or 4).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
what=${1:?"usage: scripts/gpu_multi.sh deepep|tbo_ep|dpep_serving|eplb_skew"}
if [ -n "${DRY_RUN:-}" ]; then
  n=${DRY_RUN_GPUS:-4}
else
  nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
  n=$(nvidia-smi -L | wc -l)
fi
NOISE="Warning|warn|USDT|capturing|return func"

exec 3>&1  # the terminal's stdout: dry-run lines bypass the pipes and filters after `run`
run() {  # a command, or (DRY_RUN) the line that would run
  if [ -n "${DRY_RUN:-}" ]; then echo "+ $*" >&3; else "$@"; fi
}

model() {  # model NAME -> /tmp/NAME: config + tokenizer of a dummy-weight shape
  case $1 in
    qwen3_30b_a3b) run python3 -m moeserve.tools.make_random --shape qwen3_30b_a3b --config-only \
      --out /tmp/qwen3_30b_a3b >/dev/null;;
    dsv3) run python3 -m moeserve.tools.make_random --shape deepseek_v3 \
      --layers "${DSV3_LAYERS:-7}" --config-only --out /tmp/dsv3 >/dev/null;;
    *) echo "unknown model $1 (qwen3_30b_a3b | dsv3)"; return 1;;
  esac
}

dummy_args() {  # dummy_args NAME: the overrides that build it with random weights
  echo "model.path=/tmp/$1 model.load_format=dummy device=cuda"
  [ "$1" = dsv3 ] && echo "model.quantization=${DSV3_QUANT:-none}"  # bf16 experts by default
}

serve_and_bench() {  # serve_and_bench NAME VARIANT PORT SERVER_OVERRIDES...
  local name=$1 variant=$2 port=$3 server ok=0; shift 3
  local log="$OUT/server_${name}_${variant}.log"
  echo "== $name $variant: $*" | tee -a "$OUT/dpep_serving.log"
  if [ -n "${DRY_RUN:-}" ]; then
    echo "+ python3 -m launch.server $* server.port=$port &" >&3
  else
    python3 -m launch.server "$@" server.port="$port" > "$log" 2>&1 &
    server=$!
    for _ in $(seq 1 120); do
      curl -sf "http://127.0.0.1:$port/health" >/dev/null && { ok=1; break; }
      kill -0 $server 2>/dev/null || break  # it died: its log says why
      sleep 2
    done
    [ $ok = 1 ] || { echo "$name $variant: server did not start"; tail -5 "$log"; \
      kill $server 2>/dev/null; wait $server; return 1; }
  fi
  for c in ${DPEP_CONC:-256 1024}; do
    run timeout 200 python3 -m moeserve.bench.serving --base-url "http://127.0.0.1:$port" \
      --num-prompts $((c * 2)) --max-concurrency "$c" --random-input-len 256 \
      --random-output-len 128 --ignore-eos --tokenizer "/tmp/$name" \
      --output-file "$OUT/dpep_serving.jsonl" 2>&1 | grep -v -E "$NOISE" \
      | tee -a "$OUT/dpep_serving.log"
  done
  [ -n "${DRY_RUN:-}" ] || { kill $server; wait $server; }
}

if [[ $what == deepep ]]; then
  if [ -n "${DRY_RUN:-}" ]; then echo "+ source scripts/build_deepep.sh" >&3
  else source scripts/build_deepep.sh || exit 1; fi
  if [ "${DEEPEP_BENCH:-1}" = 1 ]; then
    run timeout 150 python3 -m moeserve.bench.ep --world "$n" --backend p2p deepep-normal \
      deepep-low_latency --tokens 128 256 1024 4096 --iters 20 2>&1 | grep -v -E "$NOISE" \
      | tee "$OUT/bench_ep_deepep.log"
  fi
  if [ "${DEEPEP_TESTS:-1}" = 1 ]; then
    run timeout 200 python3 -m pytest tests/ep/test_deepep_real.py -q -p no:cacheprovider \
      ${DEEPEP_TEST_ARGS:-} 2>&1 | grep -v -E "$NOISE" | tee "$OUT/deepep_tests.log" \
      | grep -E "passed|failed|skipped|Error|error|^FAILED|^E " | tail -30
  fi
  if [ "${DEEPEP_DP:-1}" = 1 ]; then
    run timeout 150 python3 scripts/gpu_dp_check.py --ranks "$n" --backends p2p deepep \
      --archs deepseek_v3 --dtype bfloat16 --hidden 2048 -o parallel.deepep_mode=auto 2>&1 \
      | grep -E "identical|Error|error|shutdown|exit code" | tee "$OUT/dp_check_deepep.log"
  fi
fi

if [[ $what == tbo_ep ]]; then
  r=${TBO_RANKS:-$n}
  model dsv3
  tbo=(python3 -m moeserve.bench.tbo --model /tmp/dsv3 --name "dsv3_${DSV3_LAYERS:-7}L"
       --device cuda --ranks "$r" --backend "${TBO_BACKEND:-p2p}" --repeats 2
       -o model.load_format=dummy -o "model.quantization=${DSV3_QUANT:-none}"
       -o cache.max_running_requests=256 ${TBO_ARGS:-})
  # prefill: 8 prompts of 1024 tokens per rank in one chunk; decode: 256 requests per rank
  run timeout 270 "${tbo[@]}" --batch $((r * 8)) --input 1024 --output 2 2>&1 \
    | grep -v -E "$NOISE| INFO " | tee "$OUT/tbo_ep.log"
  run timeout 290 "${tbo[@]}" --batch $((r * 256)) --input 128 --output 32 --chunk 8192 2>&1 \
    | grep -v -E "$NOISE| INFO " | tee -a "$OUT/tbo_ep.log"
fi

if [[ $what == dpep_serving ]]; then
  port=31100
  for name in ${DPEP_MODELS-qwen3_30b_a3b dsv3}; do
    model "$name" || continue
    for v in ${DPEP_VARIANTS:-dpep dp one}; do
      port=$((port + 1))
      common="$(dummy_args "$name") cache.max_running_requests=256"
      case $v in
        dpep) serve_and_bench "$name" "$v" $port $common parallel.tp_size=$n \
                parallel.dp_size=$n parallel.a2a_backend=${DPEP_BACKEND:-p2p};;
        dp) serve_and_bench "$name" "$v" $port $common parallel.tp_size=$n \
              parallel.dp_size=$n parallel.ep_size=1;;
        one) serve_and_bench "$name" "$v" $port $common;;
        *) echo "unknown variant $v (dpep | dp | one)";;
      esac
    done
  done
  if [ "${DPEP_IDENTITY:-1}" = 1 ]; then
    run timeout 200 python3 scripts/gpu_dp_check.py --ranks "$n" --archs deepseek_v3 qwen3_moe \
      --backends "${DPEP_BACKEND:-p2p}" 2>&1 | grep -E "identical|Error|error|shutdown|exit code" \
      | tee "$OUT/dp_check_dpep.log"
  fi
fi

if [[ $what == eplb_skew ]]; then
  model dsv3
  run timeout 560 python3 -m moeserve.bench.eplb_skew --model /tmp/dsv3 \
    --name "dsv3_${DSV3_LAYERS:-7}L" --device cuda --ranks "$n" --zipf "${EPLB_ZIPF:-1.2}" \
    --redundant 8 16 --batch $((n * ${EPLB_BATCH:-128})) --input 256 --output 64 --repeats 2 \
    --chunk 8192 \
    --backend "${EPLB_BACKEND:-p2p}" --dump-dir "$OUT/eplb_dumps" -o model.load_format=dummy \
    -o "model.quantization=${DSV3_QUANT:-none}" ${EPLB_ARGS:-} 2>&1 \
    | grep -v -E "$NOISE| INFO " | tee "$OUT/eplb_skew.log"
  run python3 -m moeserve.eplb report "$OUT/eplb_dumps/dump_none.pt" 2>&1 | tail -12 \
    | tee -a "$OUT/eplb_skew.log"
fi
