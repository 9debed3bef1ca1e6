# Call 2 (same machine as call 1, warm), code c75739b, 11:48-11:51 UTC.
export NCCL_NVLS_ENABLE=0 PYTHONPATH=. D=$OUT TANDEM_CACHE_DIR=$PWD/build/spin_cache; nvidia-smi -L > $D/gpu.txt
OUT=$D/s0.8 DEADLINE_S=$((SECONDS+300)) AUTO_ACCEPTANCES=0.8 AUTO_CONCURRENCY=1,2,4,8,16,32,64 \
  AUTO_GATEWAY_ARGS="--profile-context 1088" BENCH_INTERLEAVED=1 BENCH_ARGS="--rounds 2 --requests-per-slot 4" \
  bash bench/h200_hot_path.sh auto > $D/s0.8.log 2>&1
grep -h "on the medians" -r $D/s0.8 | head -2
OUT=$D/ph DEADLINE_S=$((SECONDS+110)) PHASES_BATCHES=1 PHASES_FEATURES=1 bash bench/h200_hot_path.sh phases > $D/ph.log 2>&1
grep "phases batch" -r $D/ph | head
cd $D && tar czf all.tgz s0.8 ph s0.8.log ph.log && rm -rf s0.8 ph s0.8.log ph.log; ls
