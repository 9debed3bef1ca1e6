#!/usr/bin/env bash
# Start `tandem serve` from the current directory's code, run one command against it, stop it.
#
#   bash bench/serve_and_run.sh OUT COMMAND [tandem serve flags...]
#
# The server listens on $SERVE_PORT (default 8123; gRPC on the next port), its logs go to OUT/logs,
# and COMMAND (one string, run by bash) finds the port in $SERVE_PORT. The code is whatever
# `python3 -m tandem.cli` imports (PYTHONPATH), so a before/after comparison runs this once per tree.
set -uo pipefail
out=${1:?usage: serve_and_run.sh OUT COMMAND [serve flags]}
command=$2; shift 2
export SERVE_PORT=${SERVE_PORT:-8123}
mkdir -p "$out"
# Its banner (with the services' metrics URLs, for COMMAND to scrape) goes to OUT/serve.out too.
# SERVE_LOG_LEVEL sets TANDEM_LOG_LEVEL for the services alone (DEBUG: the gateway's line per step), not COMMAND.
TANDEM_LOG_LEVEL=${SERVE_LOG_LEVEL:-${TANDEM_LOG_LEVEL:-INFO}} python3 -m tandem.cli serve --port "$SERVE_PORT" --grpc-port $((SERVE_PORT + 1)) --log-dir "$out/logs" "$@" \
  > >(tee "$out/serve.out") 2>&1 &
serve=$!
trap 'kill -TERM $serve 2>/dev/null; wait $serve 2>/dev/null || true' EXIT
for _ in $(seq 1 600); do
  curl -sf "http://127.0.0.1:$SERVE_PORT/health" >/dev/null && break
  kill -0 $serve 2>/dev/null || { echo "tandem serve exited"; tail -n 30 "$out"/logs/*.log; exit 1; }
  sleep 1
done
bash -c "$command"
