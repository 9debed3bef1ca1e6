export NCCL_NVLS_ENABLE=0 PYTHONPATH=. D=$OUT TANDEM_CACHE_DIR=$PWD/build/spin_cache; nvidia-smi -L > $D/gpu.txt; date -u > $D/start.txt
OUT=$D/i11 DEADLINE_S=170 STACK_CONCURRENCY=1,8,64 bash bench/h200_hot_path.sh forward engine stack > $D/i11.log 2>&1; echo "== i11 $(date -u +%T)"
grep "== \|ms per step\|    1     1\|   64     1" $D/i11.log | head -30
OUT=$D/d DEADLINE_S=$(( 290 - SECONDS )) DRAFT_GROW=0 bash bench/h200_hot_path.sh draft > $D/d.log 2>&1; echo "== d $(date -u +%T)"; tail -14 $D/d.log
OUT=$D/s8 DEADLINE_S=$(( 575 - SECONDS )) AUTO_ACCEPTANCES=0.8 AUTO_GATEWAY_ARGS="--profile-context 1088" BENCH_INTERLEAVED=1 BENCH_ARGS="--rounds 2 --requests-per-slot 4" bash bench/h200_hot_path.sh auto > $D/s8.log 2>&1; echo "== s8 $(date -u +%T)"; grep -rh "auto / max" $D/s8/ | tail -3; cp $D/s8/auto_scale_*_report.log $D/ 2>/dev/null
date -u >> $D/start.txt; cd $D && tar czf all.tgz i11 d s8 i11.log d.log s8.log && rm -rf i11 d s8 i11.log d.log s8.log; ls
