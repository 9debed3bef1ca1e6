# Call 3 (code 2aee062, same machine, 15:59-16:03 UTC): the feature pick served, the timeline at one request (0.8),
# default (4 MiB) and --feature-pick-kib 0 alternated twice (next_calls.md B of the sixty-sixth session).
export NCCL_NVLS_ENABLE=0 PYTHONPATH=. D=$OUT TANDEM_CACHE_DIR=$PWD/build/spin_cache; nvidia-smi -L > $D/gpu.txt
arm() { OUT=$D/t DEADLINE_S=$(( $2 - SECONDS )) TIMELINE_CONCURRENCY=1 TIMELINE_TRACKS=scale TIMELINE_TAG=c1_$1_$3 \
  TIMELINE_TARGET_ARGS=$([ $1 = k0 ] && echo "--feature-pick-kib 0") bash bench/h200_hot_path.sh timeline \
  > $D/c1_$1_$3.log 2>&1; echo "== $1 $3"; grep "  round  \|synced->target.engine.end" $D/c1_$1_$3.log; }
arm def 80 1; arm k0 160 1; arm def 240 2; arm k0 320 2
cd $D && tar czf all.tgz t c1_* && rm -rf t c1_*; ls
