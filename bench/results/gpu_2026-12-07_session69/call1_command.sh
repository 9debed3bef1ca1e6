# Call 1 (prepared; tried at 20:22 and 20:32 UTC, no machine started): issue 11 forward, engine step and full-stack `never` at 1, 8, 64; issue 14 at 0.8 then 0.6, 1-64 (INFO)
export NCCL_NVLS_ENABLE=0 PYTHONPATH=. D=$OUT TANDEM_CACHE_DIR=$PWD/build/spin_cache; nvidia-smi -L > $D/gpu.txt; date -u > $D/start.txt
OUT=$D/i11 DEADLINE_S=170 STACK_CONCURRENCY=1,8,64 bash bench/h200_hot_path.sh forward engine stack > $D/i11.log 2>&1; echo "== i11 $(date -u +%T)"
grep "== \|ms per step\|    1     1\|   64     1" $D/i11.log | head -30
s() { OUT=$D/$1 DEADLINE_S=$(( $3 - SECONDS )) AUTO_ACCEPTANCES=$2 AUTO_GATEWAY_ARGS="--profile-context 1088" BENCH_INTERLEAVED=1 BENCH_ARGS="--rounds 2 --requests-per-slot 4" bash bench/h200_hot_path.sh auto > $D/$1.log 2>&1; echo "== $1 $(date -u +%T)"; grep -rh "auto / max" $D/$1/ | tail -3; cp $D/$1/auto_scale_*_report.log $D/ 2>/dev/null; }
s s8 0.8 375; s s6 0.6 575
date -u >> $D/start.txt; cd $D && tar czf all.tgz i11 s8 s6 i11.log s8.log s6.log && rm -rf i11 s8 s6 i11.log s8.log s6.log; ls
