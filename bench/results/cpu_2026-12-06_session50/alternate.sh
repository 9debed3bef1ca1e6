#!/usr/bin/env bash
# ageing off (worktree) against on (main), alternated, the emulated-cost CPU track at one and two requests
set -u
for rep in 1 2; do
  for tree in noage age; do
    if [[ $tree == noage ]]; then dir=/tmp/wt50; else dir=/work/main; fi
    (cd $dir && SERVE_LOG_LEVEL=INFO BENCH_INTERLEAVED=1 BENCH_ARGS="--rounds 2 --requests-per-slot 4" PYTHONPATH=$dir \
      timeout 1200 bash bench/serve_and_bench.sh /tmp/s50/emu_${tree}_$rep 1,2 never,always,auto 64 \
      --target-args="--emulate-step-cost 30,4" --draft-args="--emulate-step-cost 5,3" > /tmp/s50/emu_${tree}_$rep.log 2>&1)
    echo "$tree $rep rc $?"
  done
done
