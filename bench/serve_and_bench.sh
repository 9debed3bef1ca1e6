#!/usr/bin/env bash
# Start `tandem serve` from the current directory's code, run `tandem bench` against it, stop it.
#
#   bash bench/serve_and_bench.sh OUT CONCURRENCY MODES MAX_TOKENS [tandem serve flags...]
#
# OUT receives bench.json, bench.png and the services' logs (OUT/logs). BENCH_ARGS adds flags to each
# `tandem bench` (e.g. BENCH_ARGS="--requests-per-slot 8" for levels long enough that their ragged end
# weighs little). The code is whatever
# `python3 -m tandem.cli` imports (PYTHONPATH), so a before/after comparison runs this script
# once per tree.
set -uo pipefail
out=${1:?usage: serve_and_bench.sh OUT CONCURRENCY MODES MAX_TOKENS [serve flags]}
conc=$2; modes=$3; max_tokens=$4; shift 4
# One bench per mode, the metrics of the gateway and of each service scraped after each (their differences
# say where a round's time went: the gateway's tandem_step_phase_seconds against the services' own
# tandem_target_step_seconds, tandem_draft_step_seconds, ...). BENCH_INTERLEAVED=1 runs one bench with every
# mode instead (into OUT/all), for BENCH_ARGS="--rounds N": the modes then take turns at each level, round after
# round, and the metrics are scraped once, after it.
runs=${modes//,/ }
[[ ${BENCH_INTERLEAVED:-0} == 1 ]] && runs=all
exec bash "$(dirname "$0")/serve_and_run.sh" "$out" "
for mode in $runs; do
  bench_modes=\$mode; [[ \$mode == all ]] && bench_modes=$modes
  python3 -m tandem.cli bench --url http://127.0.0.1:\$SERVE_PORT --concurrency $conc --modes \$bench_modes \
    --max-tokens $max_tokens ${BENCH_ARGS:-} --out $out/\$mode --title \"tandem: \$mode\"
  curl -sf http://127.0.0.1:\$SERVE_PORT/metrics > $out/metrics_after_\$mode.txt || true
  awk '\$2 == \"metrics\" && \$3 ~ /^http/ {print \$1, \$3}' $out/serve.out | while read -r name url; do
    curl -sf \$url > $out/metrics_after_\${mode}_\$name.txt || true
  done
done" "$@"
