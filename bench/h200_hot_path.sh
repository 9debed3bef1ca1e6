#!/usr/bin/env bash
# Every H200 measurement of the plain-decoding hot path (issue 11), before and after, back to back.
#
#   bash bench/h200_hot_path.sh STAGE...      # on the GPU machine, from the repo root; results in $OUT
#
# "before" is the code of .before/ (a `git archive` of the commit before the change, without demo/),
# "after" the working tree. Stages:
#   tests    the kernel, graph and engine tests on the GPU (compiled Triton, real CUDA graphs)
#   forward  bench/step_cost.py: the model's forward alone, batch 1/8/64, decode and verify 8
#   engine   bench/engine_step.py: a whole TargetEngine.step, batch 1/8/64, decode and verify 8
#   stack    the full stack (tandem serve + tandem bench), `never`, concurrency 1/8/64, scale track
#            (STACK_CONCURRENCY and STACK_MODES override the levels and modes)
#   drafttests  the draft's tree-growth tests on the GPU (captured graphs)
#   draft    bench/draft_step.py before and after (a whole Draft call), and the growth alone after
#   spec     after only: `always` against `never`, scale track (acceptance 0.8) and demo track
#   features after only: `always` on the scale track (acceptance 0.8) with the drafts reading features from
#            the target (ReadFeatures) against features through the gateway (--features-through-gateway)
#   tp       after only, on nvidia-h200-x2: TP=1 against TP=2 (CUDA graphs at both): greedy texts
#            (bench/greedy_equality.py --against; demo pair float32, scale track bf16), `never` at 1 and
#            64 requests (scale track), `always` at TP=2 (forced acceptance 0.8)
#   tp8      after only, on nvidia-h200-x8 (issue 20): 8B scale track at TP=1, 2, 4 and 8 (`never` at 1 and
#            64 requests, greedy texts against TP=1), then the 70B-shaped scale track at TP=8 (recorded at
#            TP=8 by bench/scale_track.py --shape 70b --tp 8) with never/always/auto at 1..128
#   auto     after only: never, always and auto at 1..64 requests, scale track at forced acceptance 0.8
#            and 0.6 (AUTO_CONCURRENCY overrides the levels); each mode's metrics scraped after it hold
#            auto's audit (tandem_policy_goodput_tokens_per_second: predicted and measured per bucket)
#   deterministic  after only, the batch-invariant mode (issue 19) off against on: its tests on the GPU,
#            bench/engine_step.py (decode and verify 8, batch 1/8/64), and bench/greedy_equality.py
#            (64 held-out prompts: always vs never at 1 and 8 requests, never alone vs among 8),
#            demo pair in bf16, then the scale track
# Carried wheels (.whl: grpcio 1.85, FastAPI, ...) are installed into /tmp/site first.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/h200_out}
mkdir -p "$OUT"
root=$(pwd)
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
fi
site=/tmp/site
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv | tee "$OUT/gpu.txt"

run() {  # run NAME TREE TIMEOUT CMD...: in TREE (before|after), log to $OUT/NAME.log
  local name=$1 tree=$2 limit=$3; shift 3
  local dir=$root; [[ $tree == before ]] && dir=$root/.before
  local t0=$SECONDS
  (cd "$dir" && PYTHONPATH="$dir:$site" timeout "$limit" "$@") >"$OUT/$name.log" 2>&1
  echo "== $name: rc=$? in $((SECONDS - t0)) s"
  tail -n 12 "$OUT/$name.log"
}

for stage in "$@"; do
  case $stage in
    tests)
      run tests after 240 python3 -m pytest -q -x tests/test_kernels.py tests/test_target_graphs.py \
        tests/test_pipelined_grant.py tests/test_step_tail.py \
        tests/test_target_verify.py ;;
    forward)
      for tree in before after; do
        run "forward_$tree" $tree 200 python3 bench/step_cost.py --batches 1,8,64 --nodes 8 --iters 20 \
          --out "$OUT/forward_$tree.json"
      done ;;
    engine)
      for tree in before after; do
        extra=(); [[ $tree == after ]] && extra=(--grant 16)  # grants exist after the change only
        run "engine_$tree" $tree 240 python3 bench/engine_step.py --batches 1,8,64 --nodes 1,8 --iters 20 \
          "${extra[@]}" --out "$OUT/engine_$tree.json"
      done ;;
    drafttests)
      run drafttests after 200 python3 -m pytest -q -x tests/test_draft_device_tree.py tests/test_draft_tree.py ;;
    draft)
      for tree in before after; do
        run "draft_$tree" $tree 200 python3 bench/draft_step.py --batches 1,8,64 --budgets "3,1,4;5,4,8;6,8,16" \
          --iters 10 --out "$OUT/draft_$tree.json"
      done
      run draft_grow_after after 120 python3 bench/draft_step.py --batches 1,8,64 --budgets "3,1,4;5,4,8;6,8,16" \
        --iters 10 --grow-only --out "$OUT/draft_grow_after.json" ;;
    spec)  # after only: always against never on the scale track (forced acceptance 0.8) and the demo track
      scale=/tmp/tandem-scale
      [[ -f $scale/record.jsonl ]] || run scale_track after 200 python3 bench/scale_track.py --out $scale \
        --device cuda --max-tokens 192
      run spec_scale after 300 env SERVE_PORT=8200 bash "$root/bench/serve_and_bench.sh" "$OUT/spec_scale" \
        "${SPEC_CONCURRENCY:-1,2,4,8}" never,always 128 \
        --model $scale/target --draft $scale/draft --device cuda --max-model-len 4096 --kv-cache-gb 24 \
        --target-args=--random-weights \
        "--draft-args=--force-record $scale/record.jsonl --force-acceptance 0.8"
      run spec_demo after 200 env SERVE_PORT=8300 bash "$root/bench/serve_and_bench.sh" "$OUT/spec_demo" \
        "1,4" never,always 128 --device cuda ;;
    features)
      scale=/tmp/tandem-scale
      [[ -f $scale/record.jsonl ]] || run scale_track after 200 python3 bench/scale_track.py --out $scale \
        --device cuda --max-tokens 192
      port=8500
      for path in gateway target; do
        flag=(); [[ $path == gateway ]] && flag=(--features-through-gateway)
        port=$((port + 10))
        run "features_$path" after 300 env SERVE_PORT=$port bash "$root/bench/serve_and_bench.sh" \
          "$OUT/features_$path" "${SPEC_CONCURRENCY:-1,8,64}" always 128 \
          --model $scale/target --draft $scale/draft --device cuda --max-model-len 4096 --kv-cache-gb 24 \
          --target-args=--random-weights "${flag[@]}" \
          "--draft-args=--force-record $scale/record.jsonl --force-acceptance 0.8"
      done ;;
    tp)
      scale=/tmp/tandem-scale
      [[ -f $scale/record.jsonl ]] || run scale_track after 200 python3 bench/scale_track.py --out $scale \
        --device cuda --max-tokens 192
      port=8600
      for tp in 1 2; do
        against=(); [[ $tp == 2 ]] && against=(--against "$OUT/tp_equal_demo_1.json")
        port=$((port + 10))
        run "tp_equal_demo_$tp" after 300 env SERVE_PORT=$port bash "$root/bench/serve_and_run.sh" \
          "$OUT/tp_equal_demo_$tp" "python3 bench/greedy_equality.py --url http://127.0.0.1:\$SERVE_PORT \
          --prompts 32 --max-tokens 96 --out $OUT/tp_equal_demo_$tp.json ${against[*]}" \
          --device cuda --dtype float32 --tp $tp
        against=(); [[ $tp == 2 ]] && against=(--against "$OUT/tp_equal_scale_1.json")
        port=$((port + 10))
        run "tp_equal_scale_$tp" after 300 env SERVE_PORT=$port bash "$root/bench/serve_and_run.sh" \
          "$OUT/tp_equal_scale_$tp" "python3 bench/greedy_equality.py --url http://127.0.0.1:\$SERVE_PORT \
          --prompts 32 --max-tokens 96 --out $OUT/tp_equal_scale_$tp.json ${against[*]}" \
          --model $scale/target --draft $scale/draft --device cuda --tp $tp --max-model-len 4096 \
          --kv-cache-gb 24 --target-args=--random-weights \
          "--draft-args=--force-record $scale/record.jsonl --force-acceptance 0.8"
        port=$((port + 10))
        run "tp_stack_$tp" after 300 env SERVE_PORT=$port bash "$root/bench/serve_and_bench.sh" \
          "$OUT/tp_stack_$tp" 1,64 never,always 128 \
          --model $scale/target --draft $scale/draft --device cuda --tp $tp --max-model-len 4096 \
          --kv-cache-gb 24 --target-args=--random-weights \
          "--draft-args=--force-record $scale/record.jsonl --force-acceptance 0.8"
      done ;;
    tp8)
      scale=/tmp/tandem-scale scale70=/tmp/tandem-scale70
      [[ -f $scale/record.jsonl ]] || run scale_track after 200 python3 bench/scale_track.py --out $scale \
        --device cuda --max-tokens 192
      port=8800
      for tp in 1 2 4 8; do
        against=(); [[ $tp != 1 ]] && against=(--against "$OUT/tp8_equal_8b_1.json")
        port=$((port + 10))
        run "tp8_equal_8b_$tp" after 300 env SERVE_PORT=$port bash "$root/bench/serve_and_run.sh" \
          "$OUT/tp8_equal_8b_$tp" "python3 bench/greedy_equality.py --url http://127.0.0.1:\$SERVE_PORT \
          --prompts 32 --max-tokens 96 --out $OUT/tp8_equal_8b_$tp.json ${against[*]}" \
          --model $scale/target --draft $scale/draft --device cuda --tp $tp --max-model-len 4096 \
          --kv-cache-gb 24 --target-args=--random-weights \
          "--draft-args=--force-record $scale/record.jsonl --force-acceptance 0.8"
        port=$((port + 10))
        run "tp8_stack_8b_$tp" after 300 env SERVE_PORT=$port bash "$root/bench/serve_and_bench.sh" \
          "$OUT/tp8_stack_8b_$tp" 1,64 never 128 \
          --model $scale/target --draft $scale/draft --device cuda --tp $tp --max-model-len 4096 \
          --kv-cache-gb 24 --target-args=--random-weights
      done
      [[ -f $scale70/record.jsonl ]] || run scale_track70 after 600 python3 bench/scale_track.py --out $scale70 \
        --shape 70b --tp 8 --device cuda --max-tokens 192
      port=$((port + 10))
      run tp8_stack_70b after 600 env SERVE_PORT=$port bash "$root/bench/serve_and_bench.sh" \
        "$OUT/tp8_stack_70b" "${TP8_CONCURRENCY:-1,8,32,64,128}" never,always,auto 128 \
        --model $scale70/target --draft $scale70/draft --device cuda --tp 8 --max-model-len 4096 \
        --kv-cache-gb 24 --target-args=--random-weights \
        "--draft-args=--force-record $scale70/record.jsonl --force-acceptance 0.8" ;;
    auto)
      scale=/tmp/tandem-scale
      [[ -f $scale/record.jsonl ]] || run scale_track after 200 python3 bench/scale_track.py --out $scale \
        --device cuda --max-tokens 192
      port=8700
      for acceptance in 0.8 0.6; do
        port=$((port + 10))
        run "auto_scale_$acceptance" after 600 env SERVE_PORT=$port bash "$root/bench/serve_and_bench.sh" \
          "$OUT/auto_scale_$acceptance" "${AUTO_CONCURRENCY:-1,2,4,8,16,32,64}" never,always,auto 128 \
          --model $scale/target --draft $scale/draft --device cuda --max-model-len 4096 --kv-cache-gb 24 \
          --target-args=--random-weights \
          "--draft-args=--force-record $scale/record.jsonl --force-acceptance $acceptance"
      done ;;
    deterministic)
      run bitests after 300 python3 -m pytest -q tests/test_batch_invariant.py
      for mode in off on; do
        flag=(); [[ $mode == on ]] && flag=(--deterministic)
        run "engine_det_$mode" after 300 python3 bench/engine_step.py --batches 1,8,64 --nodes 1,8 --iters 20 \
          --modes graphs "${flag[@]}" --out "$OUT/engine_det_$mode.json"
      done
      scale=/tmp/tandem-scale
      [[ -f $scale/record.jsonl ]] || run scale_track after 200 python3 bench/scale_track.py --out $scale \
        --device cuda --max-tokens 192
      port=8400
      for track in demo scale; do
        for mode in off on; do
          serve=(--device cuda --dtype bfloat16); [[ $mode == on ]] && serve+=(--deterministic)
          [[ $track == scale ]] && serve+=(--model $scale/target --draft $scale/draft --max-model-len 4096 \
            --kv-cache-gb 24 --target-args=--random-weights \
            "--draft-args=--force-record $scale/record.jsonl --force-acceptance 0.8")
          port=$((port + 10))
          run "equality_${track}_$mode" after 400 env SERVE_PORT=$port bash "$root/bench/serve_and_run.sh" \
            "$OUT/equality_${track}_$mode" \
            "python3 bench/greedy_equality.py --url http://127.0.0.1:\$SERVE_PORT --prompts 64 \
              --max-tokens 96 --out $OUT/equality_${track}_$mode.json" "${serve[@]}"
        done
      done ;;
    stack)
      scale=/tmp/tandem-scale
      [[ -f $scale/record.jsonl ]] || run scale_track after 200 python3 bench/scale_track.py --out $scale \
        --device cuda --max-tokens 192
      for tree in before after; do
        run "stack_$tree" $tree 300 bash "$root/bench/serve_and_bench.sh" "$OUT/stack_$tree" \
          "${STACK_CONCURRENCY:-1,8,64}" "${STACK_MODES:-never}" 128 \
          --model $scale/target --draft $scale/draft --device cuda --max-model-len 4096 --kv-cache-gb 24 \
          --target-args=--random-weights
      done ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done

# Files come back from the machine at most 8 at a time: everything in one archive.
tar czf /tmp/results.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/results.tgz "$OUT/results.tgz"
ls -la "$OUT"
