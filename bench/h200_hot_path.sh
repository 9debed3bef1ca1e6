#!/usr/bin/env bash
# Every H200 measurement of the plain-decoding hot path (issue 11), before and after, back to back.
#
#   bash bench/h200_hot_path.sh STAGE...      # on the GPU machine, from the repo root; results in $OUT
#
# "before" is the code of .before/ (a `git archive` of the commit before the change, without demo/ and bench/results/
# but with demo/heldout_prompts.jsonl, which the serves' benches read),
# "after" the working tree. Stages:
#   tests    the kernel, graph and engine tests on the GPU (compiled Triton, real CUDA graphs)
#   forward  bench/step_cost.py: the model's forward alone, batch 1/8/64, decode and verify 8
#   attention  the tree attention before (.before/, where it exists) and after: the kernel and graph tests on the GPU,
#            then, alternated ATTN_REPEATS="1 2" times, bench/attention_cost.py (32 layers' launches in a graph, per
#            split count, run on each tree's kernels) and the forward at batch 1/8/64 (bench/step_cost.py); then the
#            forward's kernels profiled at batch 1 and 8 and whole engine steps (bench/engine_step.py), each tree
#   kernels  after only: bench/step_cost.py --profile, the forward's kernels at batch 1 and 64 (decode and
#            verify 8), device time per kernel beside the replayed graph's wall time; then the same
#            forward with cuBLASLt preferred for the linear layers (TORCH_BLAS_PREFER_CUBLASLT=1)
#   engine   bench/engine_step.py: a whole TargetEngine.step, batch 1/8/64, decode and verify 8
#   featurecost  bench/engine_step.py --features (before, where .before/ exists, and after): each step also
#            timed with every item asking for the target's features and their rows copied to the host, as a step
#            that feeds a draft runs in the served target (batch 1/8/64, decode and verify 8)
#   phases   after only: bench/engine_step.py --phases, a standalone step's host time part by part (validate,
#            pack, graph replay, the wait for the GPU, results), batch 1/8/64 (PHASES_BATCHES), decode and
#            verify 8; PHASES_FEATURES=1 has every item ask for features, as a served step that feeds a draft
#   stack    the full stack (tandem serve + tandem bench), `never`, concurrency 1/8/64, scale track
#            (STACK_CONCURRENCY and STACK_MODES override the levels and modes)
#   rest     the REST layer alone (no GPU): bench/rest_stream.py, the OpenAI server over the fake engine, server CPU a
#            streamed chunk at 1, 16 and 64 streams, before and after, REST_REPEATS="1 2" times alternated
#   drafttests  the draft's tree-growth and top-k kernel tests on the GPU (captured graphs, compiled Triton)
#   draft    bench/draft_step.py before and after (a whole Draft call), and the growth alone after
#            (DRAFT_GROW=0 skips the growth alone); DRAFT_REPEATS="1 2" alternates the pair twice, DRAFT_BATCHES,
#            DRAFT_BUDGETS and DRAFT_ITERS override the shapes and iterations
#   fusedlevels  after only: bench/draft_step.py without and with --fused-tree-levels (each growth level's
#            bookkeeping in one Triton launch, kernels/tree_level.py), alternated FUSED_REPEATS="1 2" times
#   mixeddepths  the draft call with its requests' depths spread (bench/draft_step.py --mixed-depths: request i at the
#            budget's steps - i % steps, as the gateway shortens the trees of requests whose acceptance is poor): each
#            depth a growth of its own (.before/'s engine under this tree's bench) against one growth per top-k and
#            size, alternated MIXED_REPEATS="1 2" times (MIXED_BATCHES, MIXED_BUDGETS); first the device-tree tests
#            on the GPU, last the uniform depths after (the depth mask's own cost)
#   fusedab  after only: bench/draft_step.py --ab-fused, the fused levels off against on inside one process (two
#            engines on one model, alternated FUSED_TURNS="6" times per shape): the process-to-process spread out
#   wakeups  after only: the draft's tests on the GPU, then bench/catch_up_cost.py, a wake-up's catch-up (a gap of
#            tokens without features, then a step's features) in eager forwards against fixed-width graph replays,
#            alternated in one process (WAKE_BATCHES="1,4,16", WAKE_GAPS="1,4,7,8,12,16,64"), idle and then with
#            another process keeping the GPU busy (--busy-gpu; WAKE_BUSY=0 skips it)
#   catchupprofile  after only: bench/catch_up_cost.py --profile, a joining prompt's catch-up (CATCHUP_BATCH requests,
#            default 16, of CATCHUP_PREFIX tokens, default 72) and a wake-up (gap CATCHUP_GAP, default 190), each under
#            torch.profiler: kernels by device time and ops by host time (the H200 took 32.6 ms for 15 prompts of 72
#            tokens, the H100 66 ms for a 15-request wake-up of 190; where does it go?)
#   featurepush  after only: bench/feature_push.py, a step's pushed features from the target's sinks to a draft's
#            store on this host: a message per sequence, one per step, and through the shared-memory ring
#   draftprofile  bench/draft_step.py --profile, budget 5/4/8: the draft call's kernels by device time, at
#            batch 1 before (where .before/ exists) and after, and at batch 64 after; then --phases (after, 3/1/4
#            and 5/4/8 at batch 1 and 64): the mean ms of each part of a call, which says where its host time goes
#   spec     `always` against `never`, scale track (acceptance 0.8) and demo track (bf16); SPEC_TREES="before
#            after" runs .before/ first (spec_*_before; it needs demo/heldout_prompts.jsonl, and the demo track
#            demo/target and demo/draft); SPEC_DEMO=0 skips the demo track, SPEC_SCALE=0 the scale track;
#            SPEC_DEMO_CONCURRENCY sets the demo track's levels (default 1,4)
#   round    after only: `never` then `always` at one request (scale track, acceptance 0.8), with the
#            gateway's phases beside the services' own step times (bench/round_breakdown.py), the drafts
#            taking pushed features (the default) and then reading them (--pull-features), back to back
#            (ROUND_CONCURRENCY overrides the level), what one gRPC stream call costs on this host
#            (bench/grpc_stream_latency.py), and a torch.profiler table of the draft call at
#            batch 1, budget 5/4/8 (bench/draft_step.py --profile; ROUND_PROFILE=0 skips it)
#   timeline after only: a speculative round at one request hop by hop (bench/round_timeline.py over the services'
#            TANDEM_TIMELINE marks), scale track at 0.8 then demo track in bf16 (TIMELINE_TRACKS, TIMELINE_CONCURRENCY,
#            TIMELINE_BENCH_ARGS override; TIMELINE_TREES="before after" runs .before/ first, as timeline_TRACK_before;
#            TIMELINE_TAG=T names the runs timeline_TRACK_T, as for a second run with DRAFT_EXTRA flags)
#            TIMELINE_TARGET_ARGS adds flags to the scale track's target (TIMELINE_TARGET_ARGS="--feature-pick-kib 4096")
#            TIMELINE_MODES (default never,always): the modes the serve runs, the last one's rounds timed;
#            TIMELINE_GATEWAY_ARGS adds the scale track's gateway flags (TIMELINE_GATEWAY_ARGS="--profile-context 1088")
#   lane     after only: the step streams on same-host lanes (tandem/lane.py; `tandem serve`'s default) against
#            gRPC (--no-step-lane), alternated LANE_REPEATS="1 2" times: `never` and `always` at LANE_CONCURRENCY
#            (default 1,8) with each process's hop marks (bench/round_timeline.py), scale track at 0.8 then demo
#            track in bf16 (LANE_TRACKS); first what one round trip costs on each (bench/grpc_stream_latency.py
#            --transports tcp,socket; LANE_LATENCY=0 skips it)
#   wakelatency  after only: the round at one request hop by hop (bench/round_timeline.py; scale track, 0.8) as the
#            machine runs it, then with every CPU kept out of deep idle states (PM QoS: /dev/cpu_dma_latency held at
#            0 us), alternated WAKELAT_REPEATS="1 2" times: whether the services' slow wake for a message (165-239 us
#            on the H200's host against 63-73 on the dev machine) is their idle cores' exit latency; cpuidle.txt
#            lists CPU 0's idle states
#   features after only: `always` on the scale track (acceptance 0.8) with the drafts reading features from
#            the target (ReadFeatures) against features through the gateway (--features-through-gateway)
#   placement  after only, on nvidia-h200-x2: `never` and `always` on the scale track (acceptance 0.8), the
#            draft on the target's GPU against on a GPU of its own (--draft-gpus 1), at PLACEMENT_CONCURRENCY
#            (default 1,8,64), each with its round breakdown
#   tp       after only, on nvidia-h200-x2: TP=1 against TP=2 (CUDA graphs at both): greedy texts
#            (bench/greedy_equality.py --against; demo pair float32, scale track bf16), `never` at 1 and
#            64 requests (scale track), `always` at TP=2 (forced acceptance 0.8); TP_SCALE_EQUALITY=0 skips the
#            scale track's texts, TP_DEMO_EQUALITY=0 the demo pair's, TP_STACK="2" benches TP=2 only
#   allreduce  after only, on nvidia-h200-x2 (or more GPUs: ALLREDUCE_WORLD): bench/allreduce_cost.py, one
#            all-reduce of 1..128 rows x 4096 bf16, NCCL against torch's symmetric-memory one-shot and
#            two-shot, eager and inside a CUDA graph of 64; and bench/tp_control.py (a step's command to
#            another rank: gloo broadcasts against a pipe)
#   tpengine after only, on nvidia-h200-x2: bench/engine_step.py at --tp 1 then --tp 2, back to back (CUDA
#            graphs, batch 1/8/64, decode and verify 8, and grants of 16 plain steps): a whole target step at
#            TP=2 (the served ParallelEngine, rank 0's time) against TP=1, without the serving path around it
#            (TPENGINE_TP="2" runs one degree; TPENGINE_PROFILE=1 also profiles rank 0's decode steps at batch 1 by
#            kernel, tpengine_tpN_profile_b1.txt)
#   tp8      after only, on nvidia-h200-x8 (issue 20): 8B scale track at TP=1, 2, 4 and 8 (`never` at 1 and
#            64 requests, greedy texts against TP=1), then the 70B-shaped scale track at TP=8 (recorded at
#            TP=8 by bench/scale_track.py --shape 70b --tp 8) with never/always/auto at 1..128
#   auto     never, always and auto at 1..64 requests, scale track at forced acceptance 0.8
#            and 0.6 (AUTO_CONCURRENCY, AUTO_ACCEPTANCES and AUTO_MODES override the levels, rates and
#            modes; AUTO_TREES="before after" runs .before/ first, as auto_scale_RATE_before (AUTO_BEFORE_MODES: its
#            modes, e.g. auto alone beside the after serve's three); AUTO_TP=N serves the
#            target at --tp N, as auto_scale_RATE_tpN; AUTO_GATEWAY_ARGS="--fed-grants" adds gateway flags,
#            AUTO_TARGET_ARGS="--graph-ragged-rows 1024" target flags); tandem bench
#            prints auto's audit per level (predicted and measured goodput per arm, tandem_policy_* sums),
#            and each mode's metrics are scraped after it; bench/auto_report.py then prints the modes side by
#            side (auto / max, the audit beside `always` and `never`) into auto_scale_RATE_report.log;
#            BENCH_ARGS="--requests-per-slot 4" makes every level twice as long (serve_and_bench.sh);
#            BENCH_INTERLEAVED=1 BENCH_ARGS="--rounds 3" runs the modes in turn at each level, three rounds, in
#            one bench (serve_and_bench.sh), and the report gives each round's auto / max and the medians
#            SERVE_LOG_LEVEL=DEBUG has the gateway log a line per target step and per plan (serve_and_run.sh),
#            and bench/step_log.py --budgets --levels --options then tabulates the trees chosen, each level's step time
#            by kind and its one-budget tree steps by budget (auto_scale_RATE_budgets.log), and bench/cost_replay.py what the cost model priced each
#            option at when each auto level began, beside what it measured (auto_scale_RATE_prices.log)
#   fedgrants after only: `auto` with fed grants (`--gateway-args=--fed-grants`: awake auto requests decode plainly
#            in grants that push each step's features to the drafts) against without (the default), each on a fresh
#            serve, demo track (bf16) then scale track (0.8), FED_CONCURRENCY (default 1,2,4); `never` (and, without
#            fed grants, `always`) on the same serves
#   fixedtrees  after only: `never` and `always` with each fixed tree of FIXED_TREES (default "5,4,8 5,1,6 10,1,11
#            3,1,4": depth,topk,tokens) on a fresh serve each, scale track at FIXED_ACCEPTANCE (default 0.8), levels
#            FIXED_CONCURRENCY (default 1,2,4): what each of auto's options delivers when it is drafted alone
#   joins    after only: a prompt chunk joining a batch through a CUDA graph (GraphConfig.max_chain_rows) against
#            eagerly: the graph and verify tests on the GPU; bench/engine_step.py --prompt-tokens (a step of b - 1
#            decode items and a new request's prompt, both ways in one engine); then never, always and auto at
#            JOIN_CONCURRENCY (default 1,2,4), scale track at 0.8, on a serve with `--graph-chain-rows 0` (prompt chunks
#            eager) and one with the default, back to back (JOIN_ROUNDS interleaved rounds, default 2; JOIN_MODES;
#            JOIN_TESTS=0 skips the tests)
#   ragged   after only: a joining prompt through ragged graphs (GraphConfig.ragged_rows, `--graph-ragged-rows`):
#            the graph tests on the GPU; bench/engine_step.py --prompt-tokens 40,96 --ragged-rows RAGGED_ROWS (default
#            1024: b - 1 decode items and a joining prompt, with today's graphs, chunks kept out, and ragged graphs);
#            then never and always (RAGGED_MODES) at RAGGED_CONCURRENCY (default 8,16,64), scale track at 0.8, on a
#            serve with `--graph-ragged-rows 0` (off; 1024 is the default since 2026-12-05) and one with RAGGED_ROWS,
#            back to back (RAGGED_ROUNDS interleaved rounds, default 2)
#   raggedeq after only: bench/greedy_equality.py on the demo pair (bf16, --deterministic unless RAGGED_EQ_FLAGS
#            is set, e.g. to "") with `--graph-ragged-rows 0`, then RAGGED_ROWS (default 1024) compared with it
#   l2prefetch  after only: each GEMM's weight asked of L2 ahead of it (kernels/l2_prefetch.py, `--l2-prefetch-mb`):
#            bench/l2_prefetch_cost.py (one-row GEMMs behind an idle window, per shape, window and cap); the forward
#            with caps L2_CAPS (default 0,16,32,0,16,32: off and on alternated in one process, batch 1/8/64, decode and
#            verify 8, bench/step_cost.py); whole engine steps off then with L2_ENGINE_MB (default 32), batch 1/64
#            (bench/engine_step.py); then `never` at L2_CONCURRENCY (default 1,64) on a scale-track serve without and
#            with `--l2-prefetch-mb L2_ENGINE_MB` (L2_ENGINE=0 skips the engine steps, L2_STACK=0 the serves)
#   autodemo the same on the demo track in bf16 (the bundled pair, its own draft's acceptance; AUTO_CONCURRENCY,
#            AUTO_MODES and AUTO_TREES as for auto), as auto_demo and auto_demo_before
#   deterministic  after only, the batch-invariant mode (issue 19) off against on: its tests on the GPU and
#            bench/engine_step.py (decode and verify 8, batch 1/8/64); DET_MATMUL="0,1 0,264" also times the
#            mode with those kernels.matmul configurations (MIN_PROGRAMS,SPLIT_K_PROGRAMS); DET_ROWS="4 8" times
#            the mode with those rows of a sequence per invariant-attention program, back to back
#            (kernels.invariant_attention.ROWS_PER_PROGRAM; the plain "on" run takes the default);
#            DET_VARIANTS="WIDE_BLOCK_N=128/- -/BLOCK_N=64,ROWS_PER_PROGRAM=8" times the mode with each
#            MATMUL/ATTENTION pair of engine_step.py --matmul and --attention specs ("-": the defaults);
#            DET_PROFILE=1 also profiles 64 x 8 steps by kernel, off and on (bench/engine_step.py --profile);
#            DET_TESTS=0 skips the tests; DET_REPEATS=N runs off and on N times, alternated;
#            DET_PIN=CPUS runs them (and the variants) under taskset -c CPUS; DET_KNOBS="NUM_STAGES=4;..." checks
#            that those kernels.matmul settings leave the linear layer's output bitwise unchanged (bench/linear_knobs.py)
#   wide     after only, the batch-invariant linear layer's wide calls (WIDE_FROM_M rows or more): its GPU tests, then
#            bench/linear_cost.py --wide over WIDE_CONFIGS (BLOCK_M,BLOCK_N,WARPS,STAGES,BLOCK_K,TMA,SPLITS_IN_PROGRAM;
#            the first, the pointer kernel with partials, is the reference) at WIDE_ROWS rows (default 128,512,2048),
#            each checked bitwise; then bench/engine_step.py mode off, on, and on with the pointer kernel and
#            partials (WIDE_TMA=0,WIDE_SPLITS_IN_PROGRAM=0), batch 1/8/64, decode and verify 8, back to back
#   linear   after only: bench/linear_cost.py, each linear weight of the 8B shapes, cuBLAS against the
#            batch-invariant kernel at 1, 8 and 64 rows
#   equality after only (EQUALITY_RUNS picks among demo_off demo_on scale_off scale_on), the mode off against on: bench/greedy_equality.py (64 held-out
#            prompts: always vs never at 1 and 8 requests, never alone vs among 8), demo pair in bf16,
#            then the scale track
# DEADLINE_S (seconds from the start) caps every run's timeout so that the results are packed before the
# device call's own limit; a run with under 30 s left is skipped.
# Carried wheels (.whl: grpcio 1.85, FastAPI, ...; `bash bench/h200_wheels.sh` fetches them) are installed into
# /tmp/site first. The device tool refused the working tree with the wheels as over its 64 MiB (2026-12-02; without
# them it passed): stages that need no wheels (wide, linear, engine timings) run without them; for the others, move
# the tracked bench/results/ (41 MB, read by no stage) out of the tree for the call and back after it.
# Each run packs its $OUT into one results.tgz, but a device call returns at most 8 files: a call that runs several
# (OUT=$D/a ..., OUT=$D/b ...) should end by packing them into one tarball (2026-12-06: three came back as none).
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

pack() {  # Files come back from the machine at most 8 at a time: everything in one archive. A run before this one
  # into the same $OUT left its archive there: its files join this one's, not a tarball inside it (2026-12-07: four
  # timeline runs into one $OUT came back nested four deep)
  if [[ -f $OUT/results.tgz ]]; then
    tar xzf "$OUT/results.tgz" -C "$OUT" --skip-old-files && rm -f "$OUT/results.tgz"
  fi
  tar czf /tmp/results.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/results.tgz "$OUT/results.tgz"
  ls -la "$OUT"
}
trap pack EXIT
trap 'exit 143' TERM

run() {  # run NAME TREE TIMEOUT CMD...: in TREE (before|after), log to $OUT/NAME.log
  local name=$1 tree=$2 limit=$3; shift 3
  if [[ -n ${DEADLINE_S:-} ]]; then
    local left=$((DEADLINE_S - SECONDS - 10))
    (( left < 30 )) && { echo "== $name: skipped, ${left} s left"; return; }
    (( left < limit )) && limit=$left
  fi
  local dir=$root; [[ $tree == before ]] && dir=$root/.before
  local t0=$SECONDS
  (cd "$dir" && PYTHONPATH="$dir:$site" timeout "$limit" "$@") >"$OUT/$name.log" 2>&1
  echo "== $name: rc=$? in $((SECONDS - t0)) s"
  tail -n 12 "$OUT/$name.log"
}

hold_pm_qos() {  # hold_pm_qos US: keep every CPU out of idle states slower to leave than US microseconds (the kernel's
                 # PM QoS request: /dev/cpu_dma_latency, held while a process keeps it open) until release_pm_qos.
                 # The file is held by a process of its own, so that nothing the runs start inherits it.
  python3 -c 'import signal, struct, sys
with open("/dev/cpu_dma_latency", "wb", buffering=0) as f:
    f.write(struct.pack("<i", int(sys.argv[1])))
    signal.pause()' "$1" &
  pm_qos_holder=$!
  sleep 0.5
  kill -0 "$pm_qos_holder" 2>/dev/null
}
release_pm_qos() { kill "$pm_qos_holder" 2>/dev/null; wait "$pm_qos_holder" 2>/dev/null; }

scale=/tmp/tandem-scale scale70=/tmp/tandem-scale70  # the scale tracks: 8B shapes, and 70B (TP=8)

need_scale() {  # need_scale NAME DIR [scale_track.py flags...]: build a scale track once per machine
  local name=$1 dir=$2; shift 2
  [[ -f $dir/record.jsonl ]] || run "$name" after 600 python3 bench/scale_track.py --out "$dir" --device cuda \
    --max-tokens 192 "$@"
}

scale_serve() {  # scale_serve DIR [ACCEPTANCE]: tandem serve flags for a scale track, into the array `serve`;
                 # with ACCEPTANCE the draft's main paths are forced to the record at that rate; DRAFT_EXTRA adds
                 # flags to the draft's (one --draft-args: a second would replace the first)
  serve=(--model "$1/target" --draft "$1/draft" --device cuda --max-model-len 4096 --kv-cache-gb 24
         --target-args=--random-weights)
  local draft_args=${DRAFT_EXTRA:-}
  [[ -n ${2:-} ]] && draft_args="--force-record $1/record.jsonl --force-acceptance $2${draft_args:+ $draft_args}"
  if [[ -n $draft_args ]]; then
    serve+=("--draft-args=$draft_args")
  fi
}

serve_bench() {  # serve_bench NAME PORT CONCURRENCY MODES SERVE_FLAGS...: tandem bench, 128 tokens, in the tree
                 # $SERVE_TREE (default after)
  local name=$1 port=$2 conc=$3 modes=$4; shift 4
  # The bench reads the held-out prompts from the tree it runs in; a .before/ made without demo/ lacks them (the
  # forty-third session's before serve stopped on that): they are data, the same in both trees.
  if [[ ${SERVE_TREE:-after} == before && ! -f $root/.before/demo/heldout_prompts.jsonl ]]; then
    mkdir -p "$root/.before/demo" && cp "$root/demo/heldout_prompts.jsonl" "$root/.before/demo/"
  fi
  run "$name" "${SERVE_TREE:-after}" 600 env SERVE_PORT=$port bash "$root/bench/serve_and_bench.sh" "$OUT/$name" \
    "$conc" "$modes" 128 "$@"
}

with_target_args() {  # with_target_args ARGS: $joined, the scale track's serve flags ($serve) with ARGS added to
                      # its target's
  local flag
  joined=()
  for flag in "${serve[@]}"; do
    [[ $flag == --target-args=--random-weights ]] && flag="--target-args=--random-weights $1"
    joined+=("$flag")
  done
}

equality() {  # equality NAME PORT PROMPTS AGAINST SERVE_FLAGS...: bench/greedy_equality.py (96 tokens) on a fresh
              # tandem serve; AGAINST: the NAME of an earlier run whose texts to compare with, or ""
  local name=$1 port=$2 prompts=$3 against=$4; shift 4
  run "$name" after 400 env SERVE_PORT=$port bash "$root/bench/serve_and_run.sh" "$OUT/$name" \
    "python3 bench/greedy_equality.py --url http://127.0.0.1:\$SERVE_PORT --prompts $prompts --max-tokens 96 \
    --out $OUT/$name.json${against:+ --against $OUT/$against.json}" "$@"
}

for stage in "$@"; do
  case $stage in
    tests)
      run tests after 240 python3 -m pytest -q -x tests/test_kernels.py tests/test_target_graphs.py \
        tests/test_pipelined_grant.py tests/test_step_tail.py \
        tests/test_target_verify.py ;;
    kernels)
      run kernels after 200 python3 bench/step_cost.py --batches 1,64 --nodes 8 --iters 20 --profile 20 \
        --out "$OUT/kernels.json"
      run kernels_cublaslt after 200 env TORCH_BLAS_PREFER_CUBLASLT=1 python3 bench/step_cost.py --batches 1,64 \
        --nodes 8 --iters 20 --profile 20 --out "$OUT/kernels_cublaslt.json" ;;
    attention)  # the tree attention, before (.before/, where it exists) and after, back to back
      run attention_tests after 240 python3 -m pytest -q -x tests/test_kernels.py tests/test_target_graphs.py
      trees=after; [[ -d $root/.before ]] && trees="before after"
      for rep in ${ATTN_REPEATS:-1 2}; do
        for tree in $trees; do
          run "attention_cost_${tree}_$rep" $tree 200 python3 "$root/bench/attention_cost.py" \
            --out "$OUT/attention_cost_${tree}_$rep.json"
          run "forward_${tree}_$rep" $tree 200 python3 bench/step_cost.py --batches 1,8,64 --nodes 8 --iters 30 \
            --out "$OUT/forward_${tree}_$rep.json"
        done
      done
      for tree in $trees; do
        run "kernels_$tree" $tree 200 python3 bench/step_cost.py --batches 1,8 --nodes 8 --iters 20 --profile 20 \
          --out "$OUT/kernels_$tree.json"
        run "engine_$tree" $tree 240 python3 bench/engine_step.py --batches 1,8,64 --nodes 1,8 --iters 20 \
          --modes graphs --grant 16 --out "$OUT/engine_$tree.json"
      done ;;
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
    featurecost)  # what asking for features adds to a step (a fed plain step, a verify step); before too if .before/
      trees=after; [[ -d $root/.before ]] && trees="before after"
      for tree in $trees; do
        run "engine_features_$tree" $tree 300 python3 bench/engine_step.py --batches 1,8,64 --nodes 1,8 \
          --iters 20 --modes graphs --features --out "$OUT/engine_features_$tree.json"
      done ;;
    phases)  # after only: where a standalone step's host time goes, part by part (bench/engine_step.py --phases)
      run engine_phases after 240 python3 bench/engine_step.py --batches "${PHASES_BATCHES:-1,8,64}" --nodes 1,8 \
        --iters 20 --modes graphs --phases $([[ ${PHASES_FEATURES:-0} == 1 ]] && echo --features) \
        --out "$OUT/engine_phases.json" ;;
    drafttests)
      run drafttests after 200 python3 -m pytest -q -x tests/test_draft_device_tree.py tests/test_draft_tree.py \
        tests/test_topk.py tests/test_tree_level.py ;;
    draft)
      for rep in ${DRAFT_REPEATS:-1}; do
        for tree in before after; do
          suffix=""; [[ $rep != 1 ]] && suffix=_$rep
          run "draft_$tree$suffix" $tree 200 python3 bench/draft_step.py --batches "${DRAFT_BATCHES:-1,8,64}" \
            --budgets "${DRAFT_BUDGETS:-3,1,4;5,4,8;6,8,16}" --iters "${DRAFT_ITERS:-10}" --out "$OUT/draft_$tree$suffix.json"
        done
      done
      [[ ${DRAFT_GROW:-1} == 1 ]] && run draft_grow_after after 120 python3 bench/draft_step.py --batches 1,8,64 \
        --budgets "3,1,4;5,4,8;6,8,16" --iters 10 --grow-only --out "$OUT/draft_grow_after.json" ;;
    mixeddepths)
      run mixed_tests after 200 python3 -m pytest -q -x tests/test_draft_device_tree.py
      for rep in ${MIXED_REPEATS:-1 2}; do
        for tree in before after; do
          engine=$root; [[ $tree == before ]] && engine=$root/.before
          # This tree's bench (the flag is new) over each tree's engine: PYTHONPATH picks the packages.
          run "mixed_${tree}_$rep" after 200 env PYTHONPATH="$engine:$site" python3 bench/draft_step.py --mixed-depths \
            --batches "${MIXED_BATCHES:-1,8,16,64}" --budgets "${MIXED_BUDGETS:-5,4,8;10,1,11;6,8,16}" \
            --iters "${DRAFT_ITERS:-10}" --out "$OUT/mixed_${tree}_$rep.json"
        done
      done
      run uniform_after after 200 python3 bench/draft_step.py --batches "${MIXED_BATCHES:-1,8,16,64}" \
        --budgets "${MIXED_BUDGETS:-5,4,8;10,1,11;6,8,16}" --iters "${DRAFT_ITERS:-10}" --out "$OUT/uniform_after.json" ;;
    fusedlevels)  # after only: the draft call with each growth level's bookkeeping in one launch, off and on,
                  # alternated FUSED_REPEATS times (default "1 2"), each in a process of its own
      for rep in ${FUSED_REPEATS:-1 2}; do
        for fused in off on; do
          run "draft_fused_${fused}_$rep" after 200 python3 bench/draft_step.py --batches "${DRAFT_BATCHES:-1,8,64}" \
            --budgets "${DRAFT_BUDGETS:-3,1,4;5,4,8;6,8,16}" --iters "${DRAFT_ITERS:-20}" \
            $([[ $fused == on ]] && echo --fused-tree-levels || echo --no-fused-tree-levels) --out "$OUT/draft_fused_${fused}_$rep.json"
        done
      done ;;
    fusedab)  # after only: the same comparison inside one process, two engines alternated FUSED_TURNS times a shape
      run draft_fused_ab after 300 python3 bench/draft_step.py --batches "${DRAFT_BATCHES:-1,8,64}" \
        --budgets "${DRAFT_BUDGETS:-3,1,4;5,4,8}" --iters "${DRAFT_ITERS:-20}" --ab-fused "${FUSED_TURNS:-6}" \
        --out "$OUT/draft_fused_ab.json" ;;
    wakeups)  # after only: a wake-up's catch-up (a gap without features) in eager forwards against fixed-width replays
      run wakeup_tests after 200 python3 -m pytest -q -x tests/test_draft_device_tree.py tests/test_draft_model.py
      run catch_up_cost after 240 python3 bench/catch_up_cost.py --batches "${WAKE_BATCHES:-1,4,16}" \
        --gaps "${WAKE_GAPS:-1,4,7,8,12,16,64}" --out "$OUT/catch_up_cost.json"
      [[ ${WAKE_BUSY:-1} == 1 ]] || continue
      # The same while another process keeps the GPU busy, as the target's steps do in a serve.
      # (Fewer shapes: every wake-up first ingests a 512-token prefix per request, slower on a shared GPU.)
      run catch_up_cost_busy after 240 python3 bench/catch_up_cost.py --batches "${WAKE_BATCHES:-1,4,16}" \
        --gaps "${WAKE_BUSY_GAPS:-1,8,16,64}" --iters 6 --turns 2 --busy-gpu --out "$OUT/catch_up_cost_busy.json" ;;
    catchupprofile)
      run catch_up_profile after 240 python3 bench/catch_up_cost.py --batches "${CATCHUP_BATCH:-16}" \
        --gaps "${CATCHUP_GAP:-190}" --prefix "${CATCHUP_PREFIX:-72}" --profile "$OUT/catch_up_profile.txt" ;;
    featurepush)
      run feature_push after 200 python3 bench/feature_push.py --batches 1,8,16,64,128 --steps 40 \
        --out "$OUT/feature_push.json" ;;
    draftprofile)
      trees=after; [[ -d $root/.before ]] && trees="before after"
      for tree in $trees; do
        run "draft_profile_${tree}_b1" $tree 150 python3 bench/draft_step.py --batches 1 --budgets "5,4,8" \
          --iters 3 --profile "$OUT/draft_profile_${tree}_b1.txt"
      done
      run draft_profile_after_b64 after 150 python3 bench/draft_step.py --batches 64 --budgets "5,4,8" \
        --iters 3 --profile "$OUT/draft_profile_after_b64.txt"
      run draft_phases_after after 150 python3 bench/draft_step.py --batches 1,64 --budgets "3,1,4;5,4,8" \
        --iters 10 --phases --out "$OUT/draft_phases_after.json" ;;
    spec)  # always against never on the scale track (forced acceptance 0.8) and the demo track (bf16);
           # SPEC_TREES="before after" runs .before/ first, as spec_*_before; SPEC_FUSED="off on" serves the scale
           # track without the draft's fused growth levels (--no-fused-tree-levels) and then with them (the
           # default), as spec_scale and spec_scale_fused
      [[ ${SPEC_SCALE:-1} == 1 ]] && need_scale scale_track $scale
      for tree in ${SPEC_TREES:-after}; do
        suffix=""; [[ $tree == before ]] && suffix=_before
        for fused in ${SPEC_FUSED:-on}; do
          [[ ${SPEC_SCALE:-1} == 1 ]] || break
          # the draft's default since the thirty-eighth session; a tree from before knows only --fused-tree-levels (off by default there)
          off=--no-fused-tree-levels; [[ $tree == before ]] && off=""
          DRAFT_EXTRA=$([[ $fused == on ]] && echo --fused-tree-levels || echo $off) scale_serve $scale 0.8
          SERVE_TREE=$tree serve_bench "spec_scale$suffix$([[ $fused == on ]] && echo _fused)" 8200 \
            "${SPEC_CONCURRENCY:-1,2,4,8}" never,always "${serve[@]}"
        done
        [[ ${SPEC_DEMO:-1} == 1 ]] &&
          SERVE_TREE=$tree serve_bench "spec_demo$suffix" 8300 "${SPEC_DEMO_CONCURRENCY:-1,4}" never,always \
            --device cuda --dtype bfloat16
      done ;;
    round)  # after only: where a round's time goes at one request, every service's metrics scraped
      need_scale scale_track $scale
      for how in push pull; do
        scale_serve $scale 0.8
        [[ $how == pull ]] && serve[-1]+=" --pull-features"  # the last flag is --draft-args=...
        serve_bench round_$how 8250 "${ROUND_CONCURRENCY:-1}" never,always "${serve[@]}"
        for mode in never always; do
          since=(); [[ $mode == always ]] && since=(--since never)
          python3 bench/round_breakdown.py "$OUT/round_$how" $mode "${since[@]}" > "$OUT/round_${how}_$mode.txt"
        done
      done
      run grpc_latency after 120 python3 bench/grpc_stream_latency.py --transports tcp,socket
      run grpc_latency_sleep after 120 python3 bench/grpc_stream_latency.py --transports tcp,socket --sleep
      [[ ${ROUND_PROFILE:-1} == 1 ]] && run draft_profile after 150 python3 bench/draft_step.py --batches 1 \
        --budgets "5,4,8" --iters 10 --profile "$OUT/draft_profile.txt" ;;
    timeline)  # after only: a speculative round at one request hop by hop: `never` then `always` on a serve whose
               # processes mark their hops (TANDEM_TIMELINE, tandem/timeline.py), read by bench/round_timeline.py,
               # beside bench/round_breakdown.py; scale track (0.8) then demo track (bf16), TIMELINE_TRACKS picks
      # TIMELINE_MODES=never,auto times auto's rounds instead of `always`'s (the marks of every speculative round
      # of the serve are read together, so one serve holds one speculating mode).
      timeline_modes=${TIMELINE_MODES:-never,always}
      for track in ${TIMELINE_TRACKS:-scale demo}; do
        if [[ $track == scale ]]; then
          need_scale scale_track $scale && scale_serve $scale 0.8 && flags=("${serve[@]}")
          if [[ -n ${TIMELINE_TARGET_ARGS:-} ]]; then with_target_args "$TIMELINE_TARGET_ARGS"; flags=("${joined[@]}"); fi
          if [[ -n ${TIMELINE_GATEWAY_ARGS:-} ]]; then flags+=("--gateway-args=$TIMELINE_GATEWAY_ARGS"); fi
        else
          flags=(--device cuda --dtype bfloat16)
        fi
        for tree in ${TIMELINE_TREES:-after}; do
          name=timeline_$track${TIMELINE_TAG:+_$TIMELINE_TAG}; [[ $tree == before ]] && name+=_before
          marks=$OUT/$name/marks
          run "$name" $tree 400 env SERVE_PORT=8450 TANDEM_TIMELINE="$marks" \
            BENCH_ARGS="${TIMELINE_BENCH_ARGS:---requests-per-slot 8}" bash "$root/bench/serve_and_bench.sh" \
            "$OUT/$name" "${TIMELINE_CONCURRENCY:-1}" "$timeline_modes" 128 "${flags[@]}"
          python3 bench/round_timeline.py "$marks" --json "$OUT/$name.json" > "$OUT/$name.txt" 2>&1
          python3 bench/round_breakdown.py "$OUT/$name" "${timeline_modes##*,}" --since never \
            > "$OUT/${name}_breakdown.txt" 2>&1
          cat "$OUT/$name.txt"
        done
      done ;;
    wakelatency)  # after only: does a service wake slowly for its next message because its idle core slept deeply?
      # The round at one request hop by hop (scale track, 0.8), as the serve runs, then with every CPU held out of
      # idle states slower to leave than 0 us (hold_pm_qos), alternated WAKELAT_REPEATS="1 2" times; the idle
      # states of CPU 0 first (cpuidle.txt)
      states=(/sys/devices/system/cpu/cpu0/cpuidle/state*/)
      if [[ -d ${states[0]} ]]; then
        for state in "${states[@]}"; do
          echo "$(cat "$state/name") exit latency $(cat "$state/latency") us"
        done > "$OUT/cpuidle.txt" 2>&1
      else  # a host (often a VM) that exposes no idle states: the hold below has nothing to act on
        echo "CPU 0 exposes no cpuidle states" > "$OUT/cpuidle.txt"
      fi
      cat "$OUT/cpuidle.txt"
      need_scale scale_track $scale && scale_serve $scale 0.8
      for repeat in ${WAKELAT_REPEATS:-1 2}; do
        for qos in off on; do
          name=wakelat_${qos}_$repeat marks=$OUT/wakelat_${qos}_$repeat/marks
          if [[ $qos == on ]] && ! hold_pm_qos 0; then
            echo "== $name: /dev/cpu_dma_latency cannot be held here"; continue
          fi
          run "$name" after 300 env SERVE_PORT=8460 TANDEM_TIMELINE="$marks" BENCH_ARGS="--requests-per-slot 8" \
            bash "$root/bench/serve_and_bench.sh" "$OUT/$name" 1 never,always 128 "${serve[@]}"
          [[ $qos == off ]] || release_pm_qos
          python3 bench/round_timeline.py "$marks" --json "$OUT/$name.json" > "$OUT/$name.txt" 2>&1
          head -n 14 "$OUT/$name.txt"
        done
      done ;;
    lane)
      [[ ${LANE_LATENCY:-1} == 1 ]] && run lane_latency after 240 python3 bench/grpc_stream_latency.py --servers sync --transports tcp,socket \
        --work-ms 0,1,7 --sleep
      for track in ${LANE_TRACKS:-scale demo}; do
        if [[ $track == scale ]]; then
          need_scale scale_track $scale && scale_serve $scale 0.8 && flags=("${serve[@]}")
        else
          flags=(--device cuda --dtype bfloat16)
        fi
        for repeat in ${LANE_REPEATS:-1 2}; do
          for way in grpc lane; do
            name=lane_${track}_${way}_$repeat
            extra=(); [[ $way == grpc ]] && extra=(--no-step-lane)
            run "$name" after 400 env SERVE_PORT=8470 TANDEM_TIMELINE="$OUT/$name/marks" \
              BENCH_ARGS="${LANE_BENCH_ARGS:---requests-per-slot 8}" bash "$root/bench/serve_and_bench.sh" \
              "$OUT/$name" "${LANE_CONCURRENCY:-1,8}" never,always 128 "${flags[@]}" "${extra[@]}"
            python3 bench/round_timeline.py "$OUT/$name/marks" --json "$OUT/$name.json" > "$OUT/$name.txt" 2>&1
            tail -n 4 "$OUT/$name.txt"
          done
        done
      done ;;
    features)
      need_scale scale_track $scale
      scale_serve $scale 0.8
      serve_bench features_gateway 8510 "${SPEC_CONCURRENCY:-1,8,64}" always "${serve[@]}" --features-through-gateway
      serve_bench features_target 8520 "${SPEC_CONCURRENCY:-1,8,64}" never,always "${serve[@]}" ;;
    placement)
      need_scale scale_track $scale
      for where in shared own; do
        scale_serve $scale 0.8
        [[ $where == own ]] && serve+=(--draft-gpus 1)
        serve_bench placement_$where 8270 "${PLACEMENT_CONCURRENCY:-1,8,64}" never,always "${serve[@]}"
        python3 bench/round_breakdown.py "$OUT/placement_$where" always --since never \
          > "$OUT/placement_${where}_always.txt"
      done ;;
    allreduce)
      run allreduce after 300 python3 bench/allreduce_cost.py --world "${ALLREDUCE_WORLD:-2}" \
        --out "$OUT/allreduce.json"
      run tp_control after 60 python3 bench/tp_control.py ;;
    tpengine)  # after only: whole engine steps at TP=1 then TP=2, no server around them
      for tp in ${TPENGINE_TP:-1 2}; do
        if [[ ${TPENGINE_PROFILE:-0} == 1 ]]; then  # batch 1 last: its decode steps are the ones profiled
          run "tpengine_tp$tp" after 300 python3 bench/engine_step.py --batches 64,8,1 --nodes 8,1 --iters 20 \
            --modes graphs --grant 16 --tp $tp --out "$OUT/tpengine_tp$tp.json" \
            --profile "$OUT/tpengine_tp${tp}_profile_b1.txt"
        else
          run "tpengine_tp$tp" after 300 python3 bench/engine_step.py --batches 1,8,64 --nodes 1,8 --iters 20 \
            --modes graphs --grant 16 --tp $tp --out "$OUT/tpengine_tp$tp.json"
        fi
      done ;;
    tp)
      need_scale scale_track $scale
      scale_serve $scale 0.8
      for tp in 1 2; do
        against=""; [[ $tp == 2 ]] && against=1
        [[ ${TP_DEMO_EQUALITY:-1} == 1 ]] &&
          equality "tp_equal_demo_$tp" $((8600 + 30 * tp)) 32 "${against:+tp_equal_demo_1}" \
            --device cuda --dtype float32 --tp $tp
        [[ ${TP_SCALE_EQUALITY:-1} == 1 ]] &&
          equality "tp_equal_scale_$tp" $((8610 + 30 * tp)) 32 "${against:+tp_equal_scale_1}" "${serve[@]}" --tp $tp
        [[ " ${TP_STACK:-1 2} " == *" $tp "* ]] &&
          serve_bench "tp_stack_$tp" $((8620 + 30 * tp)) 1,64 "$([[ $tp == 1 ]] && echo never || echo never,always)" \
            "${serve[@]}" --tp $tp
      done ;;
    tp8)
      need_scale scale_track $scale
      scale_serve $scale 0.8
      for tp in 1 2 4 8; do
        against=""; [[ $tp != 1 ]] && against=1
        equality "tp8_equal_8b_$tp" $((8800 + 20 * tp)) 32 "${against:+tp8_equal_8b_1}" "${serve[@]}" --tp $tp
        serve_bench "tp8_stack_8b_$tp" $((8810 + 20 * tp)) 1,64 never "${serve[@]}" --tp $tp
      done
      need_scale scale_track70 $scale70 --shape 70b --tp 8
      scale_serve $scale70 0.8
      serve_bench tp8_stack_70b 8990 "${TP8_CONCURRENCY:-1,8,32,64,128}" never,always,auto "${serve[@]}" --tp 8 ;;
    auto)
      need_scale scale_track $scale
      for acceptance in ${AUTO_ACCEPTANCES:-0.8 0.6}; do
        scale_serve $scale $acceptance
        [[ -n ${AUTO_TP:-} ]] && serve+=(--tp "$AUTO_TP")
        [[ -n ${AUTO_GATEWAY_ARGS:-} ]] && serve+=("--gateway-args=$AUTO_GATEWAY_ARGS")
        if [[ -n ${AUTO_TARGET_ARGS:-} ]]; then with_target_args "$AUTO_TARGET_ARGS"; serve=("${joined[@]}"); fi
        for tree in ${AUTO_TREES:-after}; do
          suffix=""; modes=${AUTO_MODES:-never,always,auto}
          [[ $tree == before ]] && suffix=_before && modes=${AUTO_BEFORE_MODES:-$modes}
          [[ -n ${AUTO_TP:-} ]] && suffix+=_tp$AUTO_TP
          SERVE_TREE=$tree serve_bench "auto_scale_$acceptance$suffix" $((8700 + ${acceptance#0.})) \
            "${AUTO_CONCURRENCY:-1,2,4,8,16,32,64}" "$modes" "${serve[@]}"
          run "auto_scale_${acceptance}${suffix}_report" after 60 python3 bench/auto_report.py \
            "$OUT/auto_scale_$acceptance$suffix"
          # The trees each plan chose and what they delivered (every mode's trees: AUTO_MODES=auto for auto's alone).
          # (An `if`, not `[[ ]] &&`: as the stage's last command a false test made the whole script exit 1.)
          # With each level's split of its step time by kind (decode steps with and without trees, fed steps,
          # steps with prompt chunks): what the gate must charge an arm beyond its decode steps.
          if [[ ${SERVE_LOG_LEVEL:-} == DEBUG ]]; then
            levels=()
            for bench_json in "$OUT/auto_scale_$acceptance$suffix"/*/bench.json; do levels+=(--levels "$bench_json"); done
            run "auto_scale_${acceptance}${suffix}_budgets" after 60 \
              python3 bench/step_log.py "$OUT/auto_scale_$acceptance$suffix/logs/gateway.log" --budgets "${levels[@]}" --options
            # What the drafts' wake-ups and joining prompts cost, level by level (their DEBUG catch-up lines).
            run "auto_scale_${acceptance}${suffix}_catch_ups" after 60 \
              python3 bench/catch_up_log.py "$OUT/auto_scale_$acceptance$suffix/logs/draft0.log" "${levels[@]}"
            # Each option's price at each auto level's start beside what it measured (the first bench.json's levels).
            run "auto_scale_${acceptance}${suffix}_prices" after 60 \
              python3 bench/cost_replay.py "$OUT/auto_scale_$acceptance$suffix/logs/gateway.log" "${levels[@]:0:2}"
          fi
        done
      done ;;
    fedgrants)  # after only: auto with fed grants (--fed-grants) against without (the default) on fresh serves, back to
                # back, demo track (bf16) then scale track (0.8); FED_TRACKS, FED_CONCURRENCY (default 1,2,4)
      for track in ${FED_TRACKS:-demo scale}; do
        if [[ $track == scale ]]; then
          need_scale scale_track $scale
          scale_serve $scale 0.8
          flags=("${serve[@]}")
        else
          flags=(--device cuda --dtype bfloat16)
        fi
        for how in off on; do
          extra=(--gateway-args=--fed-grants); modes=never,auto
          [[ $how == off ]] && extra=() && modes=never,always,auto
          port=8900; [[ $track == scale ]] && port=$((port + 50)); [[ $how == on ]] && port=$((port + 20))
          serve_bench "fed_${track}_$how" $port "${FED_CONCURRENCY:-1,2,4}" $modes \
            "${flags[@]}" "${extra[@]}"
        done
        run "fed_${track}_report" after 60 python3 bench/auto_report.py "$OUT/fed_${track}_off"
      done ;;
    joins)
      [[ ${JOIN_TESTS:-1} == 1 ]] && run jointests after 240 python3 -m pytest -q -x tests/test_target_graphs.py \
        tests/test_target_verify.py
      run engine_join after 240 python3 bench/engine_step.py --batches 1,4,16,64 --nodes 1 --prompt-tokens 40,64 \
        --iters 10 --modes graphs --out "$OUT/engine_join.json"
      need_scale scale_track $scale
      scale_serve $scale 0.8
      for rows in 0 512; do
        with_target_args "--graph-chain-rows $rows"
        BENCH_ARGS="--rounds ${JOIN_ROUNDS:-2} --requests-per-slot 4" BENCH_INTERLEAVED=1 serve_bench \
          "join_rows$rows" $((8650 + rows % 100)) "${JOIN_CONCURRENCY:-1,2,4}" "${JOIN_MODES:-never,always,auto}" "${joined[@]}"
        run "join_rows${rows}_report" after 60 python3 bench/auto_report.py "$OUT/join_rows$rows"
      done ;;
    ragged)  # after only: prompt chunks through ragged graphs (--graph-ragged-rows) against none (0 rows)
      [[ ${RAGGED_TESTS:-1} == 1 ]] && run raggedtests after 240 python3 -m pytest -q -x tests/test_target_graphs.py
      run engine_ragged after 240 python3 bench/engine_step.py --batches 4,8,16,64 --nodes 1 --prompt-tokens 40,96 \
        --ragged-rows "${RAGGED_ROWS:-1024}" --iters 10 --modes graphs --out "$OUT/engine_ragged.json"
      need_scale scale_track $scale
      scale_serve $scale 0.8
      for rows in 0 "${RAGGED_ROWS:-1024}"; do
        with_target_args "--graph-ragged-rows $rows"
        BENCH_ARGS="--rounds ${RAGGED_ROUNDS:-2} --requests-per-slot 4" BENCH_INTERLEAVED=1 serve_bench \
          "ragged_rows$rows" $((8750 + rows % 100)) "${RAGGED_CONCURRENCY:-8,16,64}" "${RAGGED_MODES:-never,always}" \
          "${joined[@]}"
        run "ragged_rows${rows}_report" after 60 python3 bench/auto_report.py "$OUT/ragged_rows$rows"
      done ;;
    raggedeq)  # after only: greedy texts of the demo pair in bf16 with ragged graphs off, then on (compared with off),
               # --deterministic unless RAGGED_EQ_FLAGS says otherwise
      for rows in 0 "${RAGGED_ROWS:-1024}"; do
        against=""; [[ $rows != 0 ]] && against=raggedeq_rows0
        equality "raggedeq_rows$rows" $((8460 + rows % 100)) 64 "$against" --device cuda --dtype bfloat16 \
          ${RAGGED_EQ_FLAGS---deterministic} "--target-args=--graph-ragged-rows $rows"
      done ;;
    l2prefetch)  # after only: weights asked of L2 ahead of their GEMM, off against on
      run l2prefetch_tests after 240 python3 -m pytest -q -x tests/test_l2_prefetch.py
      run l2prefetch_cost after 300 python3 bench/l2_prefetch_cost.py --out "$OUT/l2prefetch_cost.json"
      run forward_l2prefetch after 300 python3 bench/step_cost.py --batches 1,8,64 --nodes 8 --iters 30 \
        --l2-prefetch-mb "${L2_CAPS:-0,16,32,0,16,32}" --out "$OUT/forward_l2prefetch.json"
      for mb in 0 "${L2_ENGINE_MB:-32}"; do
        [[ ${L2_ENGINE:-1} == 1 ]] || break
        run "engine_l2prefetch_$mb" after 240 python3 bench/engine_step.py --batches 1,64 --nodes 1,8 --iters 20 \
          --modes graphs --l2-prefetch-mb "$mb" --out "$OUT/engine_l2prefetch_$mb.json"
      done
      [[ ${L2_STACK:-1} == 1 ]] || continue
      need_scale scale_track $scale
      scale_serve $scale
      port=8770
      for mb in 0 "${L2_ENGINE_MB:-32}"; do
        with_target_args "--l2-prefetch-mb $mb"
        serve_bench "stack_l2prefetch_$mb" $port "${L2_CONCURRENCY:-1,64}" never "${joined[@]}"
        port=$((port + 10))
      done ;;
    fixedtrees)
      need_scale scale_track $scale
      scale_serve $scale "${FIXED_ACCEPTANCE:-0.8}"
      port=8600
      for tree in ${FIXED_TREES:-5,4,8 5,1,6 10,1,11 3,1,4}; do
        IFS=, read -r depth topk tokens <<<"$tree"
        port=$((port + 10))
        serve_bench "fixed_${depth}_${topk}_${tokens}" $port "${FIXED_CONCURRENCY:-1,2,4}" never,always "${serve[@]}" \
          --spec-steps "$depth" --spec-topk "$topk" --spec-draft-tokens "$tokens"
        run "fixed_${depth}_${topk}_${tokens}_report" after 60 python3 bench/auto_report.py \
          "$OUT/fixed_${depth}_${topk}_${tokens}"
      done ;;
    autodemo)
      for tree in ${AUTO_TREES:-after}; do
        suffix=""; [[ $tree == before ]] && suffix=_before
        SERVE_TREE=$tree serve_bench "auto_demo$suffix" 8360 "${AUTO_CONCURRENCY:-1,2,4,8,16,32,64}" \
          "${AUTO_MODES:-never,always,auto}" --device cuda --dtype bfloat16 \
          ${AUTO_GATEWAY_ARGS:+"--gateway-args=$AUTO_GATEWAY_ARGS"}
        run "auto_demo${suffix}_report" after 60 python3 bench/auto_report.py "$OUT/auto_demo$suffix"
      done ;;
    deterministic)
      # On one GPU the TP=2 check runs its kernels interpreted on the CPU (kernels/_triton.py makes Triton
      # 3.6's interpreter take scalar arguments as NumPy 2 wants); where there are two GPUs it runs on NCCL.
      [[ ${DET_TESTS:-1} == 1 ]] && run bitests after 300 python3 -m pytest -q tests/test_batch_invariant.py
      for repeat in $(seq "${DET_REPEATS:-1}"); do  # off and on alternated, each in a process of its own
        for mode in off on; do
          flag=(); [[ $mode == on ]] && flag=(--deterministic)
          name=engine_det_$mode; (( repeat > 1 )) && name+="_$repeat"
          run "$name" after 300 ${DET_PIN:+taskset -c "$DET_PIN"} python3 bench/engine_step.py --batches 1,8,64 \
            --nodes 1,8 --iters "${DET_ITERS:-20}" \
            --modes graphs "${flag[@]}" --out "$OUT/$name.json"
        done
      done
      for config in ${DET_MATMUL:-}; do  # other configurations of the invariant linear kernel, mode on
        run "engine_det_on_$config" after 300 python3 bench/engine_step.py --batches 1,8,64 --nodes 1,8 \
          --iters 20 --modes graphs --deterministic --matmul "$config" --out "$OUT/engine_det_on_$config.json"
      done
      for variant in ${DET_VARIANTS:-}; do  # MATMUL_SPEC/ATTENTION_SPEC ("-": the defaults), mode on
        matmul_spec=${variant%%/*} attention_spec=${variant#*/}
        flags=()
        [[ $matmul_spec != - ]] && flags+=(--matmul "$matmul_spec")
        [[ $attention_spec != - ]] && flags+=(--attention "$attention_spec")
        name="engine_det_on_${variant//\//__}"
        run "$name" after 300 ${DET_PIN:+taskset -c "$DET_PIN"} python3 bench/engine_step.py --batches 1,8,64 \
          --nodes 1,8 --iters "${DET_ITERS:-20}" --modes graphs --deterministic "${flags[@]}" --out "$OUT/$name.json"
      done
      for rows in ${DET_ROWS:-}; do  # rows of one sequence per invariant-attention program, mode on
        run "engine_det_on_rows$rows" after 300 python3 bench/engine_step.py --batches 1,8,64 --nodes 1,8 \
          --iters 20 --modes graphs --deterministic --attention-rows "$rows" --out "$OUT/engine_det_on_rows$rows.json"
      done
      if [[ -n ${DET_KNOBS:-} ]]; then  # whether other kernels.matmul "how" settings change any bit of its output
        run det_knobs after 200 python3 bench/linear_knobs.py --specs "$DET_KNOBS"
      fi
      if [[ ${DET_PROFILE:-0} == 1 ]]; then  # where 64 x 8 goes, by kernel, mode off and on
        for mode in off on; do
          flag=(); [[ $mode == on ]] && flag=(--deterministic)
          run "det_profile_$mode" after 200 python3 bench/engine_step.py --batches 64 --nodes 8 --iters 5 \
            --modes graphs "${flag[@]}" --profile "$OUT/det_profile_$mode.txt"
        done
      fi ;;
    wide)
      run widetests after 300 python3 -m pytest -q tests/test_batch_invariant.py -k "linear or wide"
      run wide after 400 python3 bench/linear_cost.py --shape 8b --rows "${WIDE_ROWS:-128,512,2048}" --iters 10 \
        --reps 10 --wide "${WIDE_CONFIGS:-128,256,8,3,64,0,0;128,256,8,3,64,1,0;128,256,8,3,64,1,1}" \
        --out "$OUT/wide.json"
      for variant in off on ${WIDE_ENGINE_VARIANTS:-WIDE_TMA=0,WIDE_SPLITS_IN_PROGRAM=0}; do
        flags=(--deterministic); [[ $variant == off ]] && flags=(); [[ $variant == *=* ]] && flags+=(--matmul "$variant")
        run "engine_wide_${variant//[=,]/_}" after 300 python3 bench/engine_step.py --batches 1,8,64 --nodes 1,8 \
          --iters "${DET_ITERS:-20}" --modes graphs "${flags[@]}" --out "$OUT/engine_wide_${variant//[=,]/_}.json"
      done ;;
    linear)  # the linear layers alone, cuBLAS against the batch-invariant kernel in several configurations
      run linear after 120 python3 bench/linear_cost.py --shape 8b --rows 1,8,64 \
        --configs "${LINEAR_CONFIGS:-256,264;0,1;0,264;0,528}" --out "$OUT/linear.json" ;;
    equality)
      need_scale scale_track $scale
      scale_serve $scale 0.8
      declare -A eq_port=([demo_off]=8410 [demo_on]=8420 [scale_off]=8430 [scale_on]=8440)
      for run_name in ${EQUALITY_RUNS:-demo_off demo_on scale_off scale_on}; do
        flags=(--device cuda); [[ $run_name == scale_* ]] && flags=("${serve[@]}")
        [[ $run_name == *_on ]] && flags+=(--deterministic)
        equality "equality_$run_name" "${eq_port[$run_name]}" 64 "" "${flags[@]}" --dtype bfloat16
      done ;;
    rest)  # the REST layer alone on this host: server CPU a streamed chunk (bench/rest_stream.py), before and after
      for rep in ${REST_REPEATS:-1 2}; do
        for tree in before after; do  # the after tree's script; PYTHONPATH picks the tree's gateway
          run "rest_${tree}_$rep" $tree 150 python3 "$root/bench/rest_stream.py" --streams 1,16,64 --chunks 10000
        done
      done ;;
    stack)
      need_scale scale_track $scale
      scale_serve $scale
      for tree in before after; do
        run "stack_$tree" $tree 300 bash "$root/bench/serve_and_bench.sh" "$OUT/stack_$tree" \
          "${STACK_CONCURRENCY:-1,8,64}" "${STACK_MODES:-never}" 128 "${serve[@]}"
      done ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
