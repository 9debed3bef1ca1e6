export NCCL_NVLS_ENABLE=0 PYTHONPATH=. D=$OUT TANDEM_CACHE_DIR=$PWD/build/spin_cache; nvidia-smi -L > $OUT/gpu.txt
arm() { OUT=$D/s$1 DEADLINE_S=$(($2-SECONDS)) TANDEM_LANE_SPIN_US=$([ $1 = 0 ] && echo 0 || echo 20000) AUTO_ACCEPTANCES=0.8 AUTO_CONCURRENCY=1,8,32 AUTO_GATEWAY_ARGS="--profile-context 1088" BENCH_INTERLEAVED=1 BENCH_ARGS="--rounds 3 --requests-per-slot 4" bash bench/h200_hot_path.sh auto > $D/s$1.log 2>&1; grep -A1 "on the medians" $D/s$1.log | head -3; }
arm 0 285; arm c 575
cd $D && tar czf all.tgz s0 sc && rm -rf s0 sc; ls
