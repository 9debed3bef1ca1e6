#!/usr/bin/env bash
# The scale track end to end: build it, serve it, bench never/always/auto against concurrency.
#
#   bash bench/scale_stack.sh OUT [CONCURRENCY] [ACCEPTANCE] [MAX_TOKENS] [-- extra scale_track.py flags]
#
# OUT receives scale/bench.json, scale/bench.png and the services' logs. On a GPU this draws an
# 8B-shaped target (bench/scale_track.py); with SCALE_TINY=1 it is a CPU smoke run of the same path.
set -euo pipefail
out=${1:?usage: bash bench/scale_stack.sh OUT [CONCURRENCY] [ACCEPTANCE] [MAX_TOKENS]}
conc=${2:-1,2,4,8,16,32,64}
acceptance=${3:-0.8}
max_tokens=${4:-128}
repo=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
scale=${SCALE_DIR:-/tmp/tandem-scale}
device=cuda; tiny=(); label="scale track (8B-shaped random weights, forced acceptance $acceptance)"
if [[ "${SCALE_TINY:-0}" == 1 ]]; then
  device=cpu; tiny=(--tiny); label="scale track smoke run (tiny random weights, forced acceptance $acceptance)"
fi
mkdir -p "$out/scale"
[[ -f "$scale/record.jsonl" ]] || python3 "$repo/bench/scale_track.py" --out "$scale" --device "$device" \
  --max-tokens $((max_tokens + 64)) "${tiny[@]}"
port=${SCALE_PORT:-8123}
python3 -m tandem.cli serve --model "$scale/target" --draft "$scale/draft" --device "$device" \
  --port "$port" --grpc-port $((port + 1)) --max-model-len 4096 --kv-cache-gb "${SCALE_KV_GB:-$([[ $device == cuda ]] && echo 24 || echo 0.5)}" \
  --log-dir "$out/scale/logs" --target-args="--random-weights" \
  --draft-args="--force-record $scale/record.jsonl --force-acceptance $acceptance" &
serve=$!
trap 'kill -TERM $serve 2>/dev/null; wait $serve 2>/dev/null || true' EXIT
for _ in $(seq 1 600); do
  curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
  kill -0 $serve 2>/dev/null || { echo "tandem serve exited"; exit 1; }
  sleep 1
done
python3 -m tandem.cli bench --url "http://127.0.0.1:$port" --concurrency "$conc" --max-tokens "$max_tokens" \
  --out "$out/scale" --title "tandem: $label"
