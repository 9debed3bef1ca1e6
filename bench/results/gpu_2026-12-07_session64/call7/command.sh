export NCCL_NVLS_ENABLE=0 PYTHONPATH=. D=$OUT TANDEM_CACHE_DIR=$PWD/build/spin_cache; unset TANDEM_LANE_SPIN_US; nvidia-smi -L > $OUT/gpu.txt
sp() { [ $1 = 0 ] && echo TANDEM_LANE_SPIN_US=0 || echo TANDEM_UNUSED=1; }
tl() { env $(sp $1) OUT=$D/t DEADLINE_S=$(($2-SECONDS)) TIMELINE_CONCURRENCY=1 TIMELINE_TRACKS=scale TIMELINE_TAG=c1_$1 bash bench/h200_hot_path.sh timeline > $D/t_$1.log 2>&1; grep "  round  \|plain steps in" $D/t_$1.log; }
hi() { env $(sp $1) OUT=$D/h$1 DEADLINE_S=$(($2-SECONDS)) AUTO_ACCEPTANCES=0.8 AUTO_CONCURRENCY=64 AUTO_MODES=never,always BENCH_INTERLEAVED=1 BENCH_ARGS="--rounds 2 --requests-per-slot 4" bash bench/h200_hot_path.sh auto > $D/h$1.log 2>&1; tail -4 $D/h$1.log; }
tl 0 100; tl d 170; hi 0 290; hi d 410
cd $D && tar czf all.tgz t h0 hd && rm -rf t h0 hd; ls
