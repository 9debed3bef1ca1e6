# Call 4 (code 2aee062, same machine, 16:03-16:06 UTC): issue 14 at 0.8, 1-64 requests, the default gate (weight 16).
export NCCL_NVLS_ENABLE=0 PYTHONPATH=. D=$OUT TANDEM_CACHE_DIR=$PWD/build/spin_cache; nvidia-smi -L > $D/gpu.txt; date -u > $D/start.txt
OUT=$D/s8 DEADLINE_S=290 AUTO_ACCEPTANCES=0.8 AUTO_GATEWAY_ARGS="--profile-context 1088" BENCH_INTERLEAVED=1 \
  BENCH_ARGS="--rounds 2 --requests-per-slot 4" bash bench/h200_hot_path.sh auto > $D/s8.log 2>&1
tail -40 $D/s8.log; cd $D && tar czf all.tgz s8 && rm -rf s8; ls
