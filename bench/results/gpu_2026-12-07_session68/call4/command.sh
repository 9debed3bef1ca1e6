# Call 4 (same code and machine, 19:18-19:20 UTC): C's second pair, `auto` then `always`; the device time ran out:
# `auto`'s arm hit its 68 s deadline before its speculative rounds (c1_auto_2.log: never's alone), `always`'s ran.
export NCCL_NVLS_ENABLE=0 PYTHONPATH=. D=$OUT TANDEM_CACHE_DIR=$PWD/build/spin_cache; date -u > $D/start.txt
arm() { OUT=$D/t DEADLINE_S=$(( $2 - SECONDS )) TIMELINE_CONCURRENCY=1 TIMELINE_TRACKS=scale TIMELINE_TAG=c1_$1_$3 TIMELINE_MODES=never,$1 TIMELINE_GATEWAY_ARGS="--profile-context 1088" bash bench/h200_hot_path.sh timeline > $D/c1_$1_$3.log 2>&1; echo "== $1 $3 $(date -u +%T)"; grep "  round  \|gw.round  " $D/c1_$1_$3.log; }
arm auto 68 2; arm always 136 2
date -u >> $D/start.txt; cd $D && tar czf all.tgz t && rm -rf t; ls
