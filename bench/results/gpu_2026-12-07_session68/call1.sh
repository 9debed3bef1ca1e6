export NCCL_NVLS_ENABLE=0 PYTHONPATH=. D=$OUT TANDEM_CACHE_DIR=$PWD/build/spin_cache; nvidia-smi -L > $D/gpu.txt; date -u > $D/start.txt
OUT=$D/s6 DEADLINE_S=240 AUTO_ACCEPTANCES=0.6 AUTO_CONCURRENCY=8,16,32,64 AUTO_GATEWAY_ARGS="--profile-context 1088" BENCH_INTERLEAVED=1 BENCH_ARGS="--rounds 2 --requests-per-slot 4" bash bench/h200_hot_path.sh auto > $D/s6.log 2>&1
grep -h "on the medians" -r $D/s6.log | head -3
SERVE_LOG_LEVEL=DEBUG AUTO_ACCEPTANCES=0.8 AUTO_CONCURRENCY=16 AUTO_GATEWAY_ARGS="--profile-context 1088" BENCH_INTERLEAVED=1 BENCH_ARGS="--rounds 2 --requests-per-slot 4" OUT=$D/b DEADLINE_S=$(( 470 - SECONDS )) bash bench/h200_hot_path.sh auto > $D/b.log 2>&1
grep -h "on the medians" $D/b.log | head -3; date -u >> $D/start.txt
cd $D && tar czf all.tgz s6 b && rm -rf s6 b; ls
