# Call 2 (same code and machine, 19:13-19:15 UTC): A, issue 14 at 0.6, 16-64 requests, the default gate.
export NCCL_NVLS_ENABLE=0 PYTHONPATH=. D=$OUT TANDEM_CACHE_DIR=$PWD/build/spin_cache; nvidia-smi -L > $D/gpu.txt; date -u > $D/start.txt
OUT=$D/s6 DEADLINE_S=250 AUTO_ACCEPTANCES=0.6 AUTO_CONCURRENCY=16,32,64 AUTO_GATEWAY_ARGS="--profile-context 1088" BENCH_INTERLEAVED=1 BENCH_ARGS="--rounds 2 --requests-per-slot 4" bash bench/h200_hot_path.sh auto > $D/s6.log 2>&1; echo "== s6 $(date -u +%T)"
date -u >> $D/start.txt; cd $D && tar czf all.tgz s6 && rm -rf s6; ls
