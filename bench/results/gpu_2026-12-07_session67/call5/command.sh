# Call 5 (code 2aee062, another H100, 16:20-16:22 UTC): issue 14 at 0.6, one request, with the gateway's DEBUG log.
# The report, budgets and prices stages were skipped for time on the device; report.log, budgets.log and
# prices.log are bench/auto_report.py, bench/step_log.py --budgets --levels ... --options and bench/cost_replay.py
# run on the dev machine on the serve's folder (all.tgz).
export NCCL_NVLS_ENABLE=0 PYTHONPATH=. D=$OUT TANDEM_CACHE_DIR=$PWD/build/spin_cache; nvidia-smi -L > $D/gpu.txt; date -u > $D/start.txt
SERVE_LOG_LEVEL=DEBUG AUTO_ACCEPTANCES=0.6 AUTO_CONCURRENCY=1 AUTO_GATEWAY_ARGS="--profile-context 1088" \
  BENCH_INTERLEAVED=1 BENCH_ARGS="--rounds 2 --requests-per-slot 8" OUT=$D/a DEADLINE_S=125 \
  bash bench/h200_hot_path.sh auto > $D/auto.log 2>&1
grep -h "on the medians" $D/auto.log; cd $D && tar czf all.tgz a && rm -rf a; ls
