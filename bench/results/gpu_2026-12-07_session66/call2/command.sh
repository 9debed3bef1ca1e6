# Call 2 (code 7f146de, same machine, 13:30-13:31 UTC): issue 14 at one request, 0.8, with the gateway's DEBUG log
# (which trees auto drafted: auto.log's budgets table)
export NCCL_NVLS_ENABLE=0 PYTHONPATH=. D=$OUT TANDEM_CACHE_DIR=$PWD/build/spin_cache; nvidia-smi -L > $D/gpu.txt
SERVE_LOG_LEVEL=DEBUG AUTO_ACCEPTANCES=0.8 AUTO_CONCURRENCY=1 AUTO_GATEWAY_ARGS="--profile-context 1088" \
  BENCH_INTERLEAVED=1 BENCH_ARGS="--rounds 2 --requests-per-slot 8" OUT=$D/a DEADLINE_S=280 \
  bash bench/h200_hot_path.sh auto > $D/auto.log 2>&1
tail -60 $D/auto.log; cd $D && tar czf all.tgz a auto.log && rm -rf a; ls
