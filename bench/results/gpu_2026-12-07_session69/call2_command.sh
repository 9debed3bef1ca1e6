# Call 2 (prepared, not run): issue 12's draft call and always/never on both tracks, then auto on the demo track (bf16)
export NCCL_NVLS_ENABLE=0 PYTHONPATH=. D=$OUT TANDEM_CACHE_DIR=$PWD/build/spin_cache; nvidia-smi -L > $D/gpu.txt; date -u > $D/start.txt
OUT=$D/d DEADLINE_S=120 DRAFT_GROW=0 bash bench/h200_hot_path.sh draft > $D/d.log 2>&1; echo "== d $(date -u +%T)"; tail -14 $D/d.log
OUT=$D/sp DEADLINE_S=$(( 380 - SECONDS )) SPEC_CONCURRENCY=1,2,4,8,16 SPEC_DEMO_CONCURRENCY=1,4 bash bench/h200_hot_path.sh spec > $D/sp.log 2>&1; echo "== sp $(date -u +%T)"; tail -25 $D/sp.log
OUT=$D/ad DEADLINE_S=$(( 575 - SECONDS )) AUTO_CONCURRENCY=1,4,16,64 BENCH_INTERLEAVED=1 BENCH_ARGS="--rounds 2 --requests-per-slot 4" bash bench/h200_hot_path.sh autodemo > $D/ad.log 2>&1; echo "== ad $(date -u +%T)"; grep -rh "auto / max" $D/ad/ | tail -3; cp $D/ad/auto_demo_report.log $D/ 2>/dev/null
date -u >> $D/start.txt; cd $D && tar czf all.tgz d sp ad d.log sp.log ad.log && rm -rf d sp ad d.log sp.log ad.log; ls
