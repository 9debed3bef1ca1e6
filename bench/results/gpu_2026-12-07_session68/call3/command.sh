# Call 3 (same code and machine, 19:16-19:18 UTC): C, the round at one request hop by hop (0.8, INFO), `always` then
# `auto`, each on its own serve after `never`.
export NCCL_NVLS_ENABLE=0 PYTHONPATH=. D=$OUT TANDEM_CACHE_DIR=$PWD/build/spin_cache; nvidia-smi -L > $D/gpu.txt; date -u > $D/start.txt
arm() { OUT=$D/t DEADLINE_S=$(( $2 - SECONDS )) TIMELINE_CONCURRENCY=1 TIMELINE_TRACKS=scale TIMELINE_TAG=c1_$1_$3 TIMELINE_MODES=never,$1 TIMELINE_GATEWAY_ARGS="--profile-context 1088" bash bench/h200_hot_path.sh timeline > $D/c1_$1_$3.log 2>&1; echo "== $1 $3 $(date -u +%T)"; grep "  round  \|gw.round  " $D/c1_$1_$3.log; }
arm always 95 1; arm auto 190 1
date -u >> $D/start.txt; cd $D && tar czf all.tgz t && rm -rf t; ls
