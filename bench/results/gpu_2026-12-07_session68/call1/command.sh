# Call 1 (code eda6e2b, NVIDIA H100 80GB HBM3, 19:08-19:13 UTC): B (issue 14 at 0.8, 16 requests, DEBUG), then the own
# weight at 0.6 and 1-2 requests (2, then --spec-own-weight auto; DEBUG). The reports in each serve's folder (all.tgz)
# were made on the device.
export NCCL_NVLS_ENABLE=0 PYTHONPATH=. D=$OUT TANDEM_CACHE_DIR=$PWD/build/spin_cache; nvidia-smi -L > $D/gpu.txt; date -u > $D/start.txt
a() { SERVE_LOG_LEVEL=DEBUG AUTO_ACCEPTANCES=$2 AUTO_CONCURRENCY=$3 AUTO_GATEWAY_ARGS="--profile-context 1088 $4" BENCH_INTERLEAVED=1 BENCH_ARGS="--rounds 2 --requests-per-slot 4" OUT=$D/$1 DEADLINE_S=$(( $5 - SECONDS )) bash bench/h200_hot_path.sh auto > $D/$1.log 2>&1; echo "== $1 $(date -u +%T)"; grep -h "on the medians" $D/$1.log; }
a b 0.8 16 "" 175; a w2 0.6 1,2 "" 285; a wauto 0.6 1,2 "--spec-own-weight auto" 395
date -u >> $D/start.txt; cd $D && tar czf all.tgz b w2 wauto && rm -rf b w2 wauto; ls
