#!/usr/bin/env bash
# The long API fuzz run: start a server (tiny Llama unless MODEL is a model folder), fuzz its
# OpenAPI document with schemathesis for MINUTES (default 30) / EXAMPLES (default 20000), check
# the baseline after, stop the server. Exit status 1 when any response broke the contract.
#   scripts/fuzz.sh                 # tiny random Llama, 30 minutes
#   MODEL=DIR MINUTES=60 scripts/fuzz.sh -- model.dtype=bfloat16   # extra server overrides
set -euo pipefail
cd "$(dirname "$0")/.."
MINUTES=${MINUTES:-30}
EXAMPLES=${EXAMPLES:-20000}
PORT=${PORT:-$(python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
WORK=$(mktemp -d)
if [ -z "${MODEL:-}" ]; then
  MODEL=$WORK/tiny_llama
  python -c "from moeserve.tools.make_tiny import make_tiny; make_tiny('llama', '$MODEL')"
fi
[ "${1:-}" = "--" ] && shift
python -m launch.server "model.path=$MODEL" model.context_length=128 "server.port=$PORT" \
  "hydra.run.dir=$WORK/run" "$@" >"$WORK/server.log" 2>&1 &
SERVER=$!
trap 'kill -TERM $SERVER 2>/dev/null; wait $SERVER; echo "server log: $WORK/server.log"' EXIT
for _ in $(seq 1 600); do
  curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
  kill -0 $SERVER || { tail -50 "$WORK/server.log"; exit 1; }
  sleep 0.5
done
python -m moeserve.tools.fuzz_api --url "http://127.0.0.1:$PORT" --examples "$EXAMPLES" \
  --minutes "$MINUTES" --seed "${SEED:-$RANDOM}"
