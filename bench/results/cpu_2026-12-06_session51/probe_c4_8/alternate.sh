#!/bin/bash
# Emulated-cost CPU A/B of the probe charge: before (6564d3c) and after (0fbfab0), alternated, 4 and 8 requests.
set -u
run() {  # tree out
  (cd $1 && SERVE_LOG_LEVEL=DEBUG BENCH_INTERLEAVED=1 BENCH_ARGS="--rounds 2 --requests-per-slot 4" \
    bash bench/serve_and_bench.sh $2 4,8 never,always,auto 64 --target-args="--emulate-step-cost 30,4" \
    --draft-args="--emulate-step-cost 5,3" > $2.log 2>&1)
}
for i in 1 2; do
  run /tmp/s51/before2 /tmp/s51/cpu2/before_$i
  run /tmp/s51/dev /tmp/s51/cpu2/after_$i
done
echo done
