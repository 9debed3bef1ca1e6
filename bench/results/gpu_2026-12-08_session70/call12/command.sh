export NCCL_NVLS_ENABLE=0 PYTHONPATH=. D=$OUT TANDEM_CACHE_DIR=$PWD/build/spin_cache; nvidia-smi -L > $D/gpu.txt; date -u > $D/start.txt
OUT=$D/s6 DEADLINE_S=185 AUTO_ACCEPTANCES=0.6 AUTO_CONCURRENCY=1,16 AUTO_GATEWAY_ARGS="--profile-context 1088" BENCH_INTERLEAVED=1 BENCH_ARGS="--rounds 2 --requests-per-slot 4" bash bench/h200_hot_path.sh auto > $D/s6.log 2>&1; echo "== s6 $(date -u +%T)"; grep -h "on the medians" $D/s6.log | tail -4
date -u >> $D/start.txt; cd $D && tar czf all.tgz s6 s6.log && rm -rf s6 s6.log; ls
