#!/bin/bash
# Emulated-cost CPU A/B of the probe charge at 2 requests (where chains beat plain decoding and the gate
# re-probes plain): before (6564d3c) and after (0fbfab0), alternated, three serves each.
set -u
run() {  # tree out
  (cd $1 && SERVE_LOG_LEVEL=DEBUG BENCH_INTERLEAVED=1 BENCH_ARGS="--rounds 2 --requests-per-slot 4" \
    bash bench/serve_and_bench.sh $2 2 never,always,auto 64 --target-args="--emulate-step-cost 30,4" \
    --draft-args="--emulate-step-cost 5,3" > $2.log 2>&1)
}
for i in 1 2 3; do
  run /tmp/s51/before2 /tmp/s51/cpu3/before_$i
  run /tmp/s51/dev /tmp/s51/cpu3/after_$i
done
echo done
