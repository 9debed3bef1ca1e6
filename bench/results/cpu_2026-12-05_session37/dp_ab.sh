#!/bin/bash
# Direct push A/B on CPU: 521baaa (queued push) vs 14045b0 (push written by the step thread), lanes both
export PATH=/tmp/fresh34/.venv/bin:$PATH
for rep in 1 2; do
  for tree in prev dp; do
    out=/tmp/s37/dp_${tree}_$rep; rm -rf $out
    (cd /tmp/$tree && PYTHONPATH=/tmp/$tree TANDEM_TIMELINE=$out/marks BENCH_ARGS="--requests-per-slot 16" timeout 600 bash bench/serve_and_bench.sh $out 1 always,never 128 > $out.log 2>&1)
    echo "== $tree $rep"; grep -A2 "^always$\|^never$" $out.log | grep "^ *1 "
    PYTHONPATH=/work/main python /work/main/bench/round_timeline.py $out/marks | grep -E "push.recv  |features.start|whole round"
  done
done
