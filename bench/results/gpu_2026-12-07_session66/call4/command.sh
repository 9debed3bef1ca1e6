# Call 4 (code 7f146de, same machine, 13:32-13:35 UTC): issue 14's sweep at 0.6, 1-64 requests, with the spin on
# (predictions: ../gpu_2026-12-07_session64/next_calls.md, section 1)
export NCCL_NVLS_ENABLE=0 PYTHONPATH=. D=$OUT TANDEM_CACHE_DIR=$PWD/build/spin_cache; nvidia-smi -L > $D/gpu.txt
a=0.6; OUT=$D/s$a DEADLINE_S=$((SECONDS+290)) AUTO_ACCEPTANCES=$a AUTO_CONCURRENCY=1,2,4,8,16,32,64 \
  AUTO_GATEWAY_ARGS="--profile-context 1088" BENCH_INTERLEAVED=1 BENCH_ARGS="--rounds 2 --requests-per-slot 4" \
  bash bench/h200_hot_path.sh auto > $D/s$a.log 2>&1
grep -h -A12 "on the medians" -r $D/s$a | head -40; cd $D && tar czf all.tgz s0.6 s0.6.log && rm -rf s0.6; ls
