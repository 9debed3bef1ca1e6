#!/usr/bin/env bash
# The sixty-first session's CPU A/B: --catch-up-on-push off and on, alternated twice, demo pair (float32), `always`
# then `never` at one request, 128 tokens, 12 requests a slot, each serve's processes marking their hops.
#   bash bench/results/cpu_2026-12-07_session61/cpu_ab.sh OUT     # from the repo root, in a venv with tandem
set -u
out=${1:?usage: cpu_ab.sh OUT}
export PYTHONPATH=.
for tag in off_1 push_1 off_2 push_2; do
  d=$out/cpu_$tag
  rm -rf "$d"; mkdir -p "$d"
  extra=()
  [[ $tag == push* ]] && extra=(--draft-args=--catch-up-on-push)
  TANDEM_TIMELINE=$d/tl BENCH_ARGS="--requests-per-slot 12" bash bench/serve_and_bench.sh "$d" 1 always,never 128 \
    "${extra[@]}" > "$d/run.log" 2>&1
  python bench/round_timeline.py "$d/tl" --json "$d/timeline.json" > "$d/timeline.txt" 2>&1
done
