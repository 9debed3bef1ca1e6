#!/bin/bash
# Release riding on the next step: e83e5c6 (a Release call of its own) against 54fa9ee, demo pair, CPU
export PATH=/tmp/fresh34/.venv/bin:$PATH
for rep in 1 2; do
  for tree in ${TREES:-before after}; do
    out=/tmp/s37/rel_${tree}_$rep; rm -rf $out
    (cd /tmp/rel_$tree && PYTHONPATH=/tmp/rel_$tree BENCH_ARGS="--requests-per-slot 4" timeout 600 bash bench/serve_and_bench.sh $out 8 always 64 > $out.log 2>&1)
    echo "== $tree $rep"; grep -A2 "^always$" $out.log | grep "^ *8 "
    python3 - $out/metrics_after_always.txt <<'PY'
import re, sys
text = open(sys.argv[1]).read()
def get(name):
    m = re.search(r'^' + re.escape(name) + r' ([0-9.e+-]+)$', text, re.M)
    return float(m.group(1)) if m else float('nan')
for phase in ("update", "execute", "draft", "schedule"):
    s = get(f'tandem_step_phase_seconds_sum{{phase="{phase}"}}'); c = get(f'tandem_step_phase_seconds_count{{phase="{phase}"}}')
    print(f"  {phase}: mean {1e3 * s / c:.3f} ms over {int(c)}")
PY
  done
done
