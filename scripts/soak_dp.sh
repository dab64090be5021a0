#!/usr/bin/env bash
# The long DP soak (docs/reliability.md): a dp2 x ep2 server on a tiny Qwen3-MoE with a KV pool small
# enough to force retraction, 256 streams for 10 minutes, 20% of them hanging up (half before the
# first token, half mid-stream), 20% regex or n=2 requests. Exits non-zero if any request failed, an
# output differed from the unloaded run, or anything was left in the server afterwards.
#   scripts/soak_dp.sh [SEED] [MINUTES] [CONCURRENCY] [extra Hydra overrides...]
set -euo pipefail
cd "$(dirname "$0")/.."
seed=${1:-0}; minutes=${2:-10}; concurrency=${3:-256}; shift $(( $# < 3 ? $# : 3 ))
tiny=${TINY:-${TMPDIR:-/tmp}/moeserve-soak-qwen3-moe}
[ -f "$tiny/config.json" ] || python -m moeserve.tools.make_tiny --arch qwen3_moe --out "$tiny"
exec python -m moeserve.bench.soak --minutes "$minutes" --concurrency "$concurrency" \
    --seed "$seed" --mix 0.2 --launch model.path="$tiny" model.dtype=float32 \
    parallel.tp_size=2 parallel.dp_size=2 cache.max_total_tokens=1500 "$@"
