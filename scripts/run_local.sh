#!/usr/bin/env bash
# Run both services as local processes (what docker-compose.yml runs), stream one prompt, stop.
#   scripts/run_local.sh ["prompt"] [extra moe-client generate flags...]
# Environment: MODEL (default: the embedded models/default), EXPERT_PORT, GPU_PORT, KEEP=1 to leave
# the services running after the prompt.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
MODEL=${MODEL:-$here/models/default}
EXPERT_PORT=${EXPERT_PORT:-50061}
GPU_PORT=${GPU_PORT:-50051}
prompt=${1:-"def fibonacci(n):"}
shift || true
logs=$(mktemp -d)

expert-service --model "$MODEL" --listen "127.0.0.1:$EXPERT_PORT" >"$logs/expert.log" 2>&1 &
epid=$!
gpu-service --model "$MODEL" --experts "127.0.0.1:$EXPERT_PORT" --listen "127.0.0.1:$GPU_PORT" >"$logs/gpu.log" 2>&1 &
gpid=$!
cleanup() { [ "${KEEP:-0}" = 1 ] || kill "$gpid" "$epid" 2>/dev/null || true; }
trap cleanup EXIT

if ! moe-client health --server "127.0.0.1:$GPU_PORT" --wait 180 >/dev/null; then
  echo "services did not come up; logs in $logs" >&2
  tail -n 20 "$logs"/*.log >&2
  exit 1
fi
echo "expert-service pid $epid, gpu-service pid $gpid (logs: $logs)" >&2
echo ">>> $prompt" >&2
# sampled by default (a small model loops under greedy decoding); flags given here override these
moe-client generate --server "127.0.0.1:$GPU_PORT" "$prompt" --max-tokens "${MAX_TOKENS:-48}" \
  --temperature 0.7 --top-p 0.9 --seed 0 "$@"
