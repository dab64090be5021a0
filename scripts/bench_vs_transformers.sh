#!/usr/bin/env bash
# Side-by-side online serving benchmark: `transformers serve --continuous-batching` vs moeserve's
# server, same model folder, same random prompts, 128 output tokens, one row per concurrency.
#
#   scripts/bench_vs_transformers.sh MODEL_DIR [CONCURRENCY ...]      # default: 1 8 16
#
# Environment knobs: INPUT_LEN (128), OUTPUT_LEN (128), SERVERS ("transformers moeserve"),
# TF_PORT / OURS_PORT (free ports), STARTUP_TIMEOUT (600 s), PYTHON (python),
# TF_ARGS / OURS_ARGS (extra server args, e.g. OURS_ARGS="device=cpu"), KEEP_LOGS=1,
# PROMPTS_PER_CONC (2): prompts per run = this x the concurrency (more: longer, steadier runs),
# ROUNDS (1): the servers take turns this many times (a shared machine's speed drifts over
# minutes; the summary gives each round's ratio at each concurrency and their median).
#
# transformers serve rejects `ignore_eos` (HTTP 422), so it gets only `max_tokens` and may stop
# early at EOS; the table reports the tokens actually generated and flags rows that differ.
set -euo pipefail

if [[ $# -lt 1 || ! -d "$1" ]]; then
    echo "usage: $0 MODEL_DIR [CONCURRENCY ...]" >&2
    exit 2
fi
MODEL_DIR=$(cd "$1" && pwd)
shift
CONCURRENCIES=("$@")
[[ ${#CONCURRENCIES[@]} -eq 0 ]] && CONCURRENCIES=(1 8 16)

PYTHON=${PYTHON:-python}
INPUT_LEN=${INPUT_LEN:-128}
OUTPUT_LEN=${OUTPUT_LEN:-128}
SERVERS=${SERVERS:-"transformers moeserve"}
ROUNDS=${ROUNDS:-1}
PROMPTS_PER_CONC=${PROMPTS_PER_CONC:-2}
STARTUP_TIMEOUT=${STARTUP_TIMEOUT:-600}
REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
WORK=$(mktemp -d -t moeserve-bench-XXXXXX)
RESULTS="$WORK/results.jsonl"
SERVER_PID=""

free_port() {
    "$PYTHON" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}
TF_PORT=${TF_PORT:-$(free_port)}
OURS_PORT=${OURS_PORT:-$(free_port)}

stop_server() {
    if [[ -n "$SERVER_PID" ]] && kill -0 "$SERVER_PID" 2>/dev/null; then
        # The server runs in its own session (setsid): signal its whole process group.
        kill -TERM -- "-$SERVER_PID" 2>/dev/null || kill -TERM "$SERVER_PID" 2>/dev/null || true
        for _ in $(seq 50); do
            kill -0 "$SERVER_PID" 2>/dev/null || break
            sleep 0.2
        done
        kill -KILL -- "-$SERVER_PID" 2>/dev/null || true
        wait "$SERVER_PID" 2>/dev/null || true
    fi
    SERVER_PID=""
}

cleanup() {
    stop_server
    if [[ "${KEEP_LOGS:-0}" == 1 ]]; then
        echo "logs and results kept in $WORK" >&2
    else
        rm -rf "$WORK"
    fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

start_server() {  # NAME LOGFILE CMD...
    local name=$1 log=$2
    shift 2
    echo ">>> starting $name: $*" >&2
    setsid "$@" >"$log" 2>&1 &
    SERVER_PID=$!
}

wait_ready() {  # NAME PORT LOGFILE
    local name=$1 port=$2 log=$3 deadline=$((SECONDS + STARTUP_TIMEOUT))
    while ((SECONDS < deadline)); do
        if ! kill -0 "$SERVER_PID" 2>/dev/null; then
            echo "!!! $name exited during startup; last log lines:" >&2
            tail -n 20 "$log" >&2
            SERVER_PID=""
            return 1
        fi
        if "$PYTHON" - "$port" <<'EOF' 2>/dev/null; then
import sys, urllib.request
with urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/v1/models", timeout=5) as r:
    sys.exit(0 if r.status == 200 else 1)
EOF
            echo ">>> $name ready on port $port" >&2
            return 0
        fi
        sleep 1
    done
    echo "!!! $name not ready after ${STARTUP_TIMEOUT}s; last log lines:" >&2
    tail -n 20 "$log" >&2
    return 1
}

run_series() {  # NAME PORT EXTRA_BENCH_ARGS...
    local name=$1 port=$2 c n
    shift 2
    for c in "${CONCURRENCIES[@]}"; do
        n=$((PROMPTS_PER_CONC * c))
        ((n < 4)) && n=4
        echo ">>> $name: concurrency $c, $n prompts" >&2
        (cd "$REPO_ROOT" && "$PYTHON" -m moeserve.bench.serving \
            --base-url "http://127.0.0.1:$port" --tokenizer "$MODEL_DIR" \
            --backend openai-completions --dataset random \
            --random-input-len "$INPUT_LEN" --random-output-len "$OUTPUT_LEN" \
            --random-range-ratio 1.0 --num-prompts "$n" --max-concurrency "$c" \
            --request-rate inf --temperature 0 --seed 1 --warmup-requests 1 \
            --tag "$name" --output-file "$RESULTS" "$@") ||
            echo "!!! $name benchmark at concurrency $c failed" >&2
    done
}

for round in $(seq "$ROUNDS"); do
for server in $SERVERS; do
    case "$server" in
    transformers)
        log="$WORK/transformers_serve.log"
        # shellcheck disable=SC2086
        start_server "transformers serve" "$log" \
            transformers serve --continuous-batching --host 127.0.0.1 --port "$TF_PORT" \
            ${TF_ARGS:-} "$MODEL_DIR"
        # Its /v1/models lists MODEL_DIR itself as the model id; the benchmark reads it from there.
        if wait_ready "transformers serve" "$TF_PORT" "$log"; then
            run_series "transformers" "$TF_PORT" --no-ignore-eos-field
        fi
        stop_server
        ;;
    moeserve)
        log="$WORK/moeserve.log"
        if ! (cd "$REPO_ROOT" && "$PYTHON" -c \
            'import importlib.util, sys; sys.exit(importlib.util.find_spec("launch.server") is None)'); then
            echo "!!! launch.server is not available; skipping moeserve" >&2
            continue
        fi
        # shellcheck disable=SC2086
        start_server "moeserve" "$log" \
            env -C "$REPO_ROOT" "$PYTHON" -m launch.server "model.path=$MODEL_DIR" \
            server.host=127.0.0.1 "server.port=$OURS_PORT" ${OURS_ARGS:-}
        if wait_ready "moeserve" "$OURS_PORT" "$log"; then
            run_series "moeserve" "$OURS_PORT" --ignore-eos
        fi
        stop_server
        ;;
    *)
        echo "!!! unknown server '$server' in SERVERS" >&2
        ;;
    esac
done
done

echo
echo "model: $MODEL_DIR  input: $INPUT_LEN tok  output: $OUTPUT_LEN tok (max_tokens)"
"$PYTHON" - "$RESULTS" <<'EOF'
import json, os, statistics, sys

path = sys.argv[1]
rows = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
if not rows:
    print("no results")
    sys.exit(1)
head = ("server", "round", "conc", "ok/n", "out tok/s", "TTFT p50 ms", "ITL p50 ms",
        "E2E p50 ms", "gen/req tok", "note")
fmt = "{:<13} {:>5} {:>5} {:>6} {:>10} {:>12} {:>11} {:>11} {:>12}  {}"
print(fmt.format(*head))
seen = {}  # (server, concurrency) → rows so far: the k-th such row is round k
for r in rows:
    key = (r["tag"], r["max_concurrency"])
    seen[key] = seen.get(key, 0) + 1
    r["round"] = seen[key]
    note = []
    if r["output_len_mismatches"]:
        note.append(f"lengths differ: {r['output_len_mismatches']} reqs, "
                    f"{r['min_output_tokens']}..{r['max_output_tokens']} tok")
    if r["failed"]:
        note.append(f"{r['failed']} failed: {r['first_error'][:60]}")
    print(fmt.format(r["tag"], r["round"], r["max_concurrency"],
                     f"{r['completed']}/{r['num_prompts']}",
                     f"{r['output_throughput']:.1f}", f"{r['median_ttft_ms']:.0f}",
                     f"{r['median_itl_ms']:.1f}", f"{r['median_e2e_latency_ms']:.0f}",
                     f"{r['total_output_tokens']}/{r['total_requested_output_tokens']}",
                     "; ".join(note)))
tput = {(r["tag"], r["max_concurrency"], r["round"]): r["output_throughput"] for r in rows}
for c in sorted({r["max_concurrency"] for r in rows}):
    ratios = [tput[("moeserve", c, k)] / tput[("transformers", c, k)]
              for k in range(1, max(r["round"] for r in rows) + 1)
              if ("moeserve", c, k) in tput and tput.get(("transformers", c, k))]
    if ratios:
        print(f"moeserve / transformers output tok/s at concurrency {c}: "
              + ", ".join(f"{x:.2f}x" for x in ratios)
              + f" (median {statistics.median(ratios):.2f}x)")
EOF
