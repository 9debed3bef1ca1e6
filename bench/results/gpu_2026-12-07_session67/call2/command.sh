# Call 2 (code 2aee062, 15:54-15:59 UTC; call 1, the same command with DEADLINE_S=$((SECONDS+130)), ran out of its
# deadlines on the fresh machine and brought nothing back): issue 14 at 0.6, 1-8 requests, the gate's expected
# weight 16 (the default) and 0 (the gate as it was), two serves back to back. w16's report was skipped for time;
# w16_report.log is bench/auto_report.py run here on its folder.
export NCCL_NVLS_ENABLE=0 PYTHONPATH=. D=$OUT TANDEM_CACHE_DIR=$PWD/build/spin_cache; nvidia-smi -L > $D/gpu.txt; date -u > $D/start.txt
for w in 16 0; do OUT=$D/w$w DEADLINE_S=$((SECONDS+160)) AUTO_ACCEPTANCES=0.6 AUTO_CONCURRENCY=1,2,4,8 \
  AUTO_GATEWAY_ARGS="--profile-context 1088 --gate-expected-weight $w" BENCH_INTERLEAVED=1 \
  BENCH_ARGS="--rounds 2 --requests-per-slot 4" bash bench/h200_hot_path.sh auto > $D/w$w.log 2>&1
  echo "== w$w"; tail -3 $D/w$w.log; done
cd $D && tar czf all.tgz w16 w0 && rm -rf w16 w0; ls
