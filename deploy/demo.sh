#!/usr/bin/env bash
# The main job in one command: install into .venv, start `tandem serve` on the bundled
# demo pair (target, EAGLE-3 draft, gateway as separate processes), send a sample
# request, then keep serving until Ctrl-C. `--once` stops after the sample request.
set -euo pipefail
cd "$(dirname "$0")/.."
PORT=${PORT:-8000}
GRPC_PORT=${GRPC_PORT:-50051}

[ -d .venv ] || python3 -m venv .venv
. .venv/bin/activate
python -c "import torch" 2>/dev/null || python -m pip install -q torch==2.13.0
python -m pip install -q -e .

tandem serve --port "$PORT" --grpc-port "$GRPC_PORT" &
SERVE=$!
trap 'kill -TERM $SERVE 2>/dev/null; wait $SERVE 2>/dev/null' EXIT
trap 'exit 130' INT TERM

echo "waiting for http://127.0.0.1:$PORT/health ..." >&2
for _ in $(seq 600); do
  kill -0 $SERVE 2>/dev/null || { echo "tandem serve exited" >&2; exit 1; }
  curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
  sleep 0.5
done

echo "POST /v1/completions" >&2
curl -sf "http://127.0.0.1:$PORT/v1/completions" -H 'Content-Type: application/json' \
  -d '{"prompt": "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n", "max_tokens": 64, "temperature": 0}' \
  | python -m json.tool

if [ "${1:-}" = "--once" ]; then exit 0; fi
echo "serving: REST http://127.0.0.1:$PORT/v1, gRPC 127.0.0.1:$GRPC_PORT (Ctrl-C stops everything)" >&2
wait $SERVE
