#!/bin/bash
# Emulated-cost CPU A/B of the book's decay: before (8a8bd3c) and after (6564d3c), alternated, two serves each.
set -u
run() {  # tree out
  (cd $1 && SERVE_LOG_LEVEL=DEBUG BENCH_INTERLEAVED=1 BENCH_ARGS="--rounds 2 --requests-per-slot 4" \
    bash bench/serve_and_bench.sh $2 1,2 never,always,auto 64 --target-args="--emulate-step-cost 30,4" \
    --draft-args="--emulate-step-cost 5,3" > $2.log 2>&1)
}
for i in 1 2; do
  run /tmp/s51/before /tmp/s51/cpu/before_$i
  run /work/main /tmp/s51/cpu/after_$i
done
echo done
