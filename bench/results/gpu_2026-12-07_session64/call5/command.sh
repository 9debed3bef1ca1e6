export NCCL_NVLS_ENABLE=0 PYTHONPATH=. D=$OUT; nvidia-smi --query-gpu=name --format=csv > $OUT/gpu.txt
OUT=$D/s8 DEADLINE_S=270 AUTO_ACCEPTANCES=0.8 AUTO_CONCURRENCY=1,2,4,8,16 AUTO_GATEWAY_ARGS="--profile-context 1088" BENCH_INTERLEAVED=1 BENCH_ARGS="--rounds 3 --requests-per-slot 4" bash bench/h200_hot_path.sh auto > $D/s8.log 2>&1; tail -25 $D/s8.log
for i in 1 2; do OUT=$D/demo_$i DEADLINE_S=$((270+i*150-SECONDS)) SERVE_LOG_LEVEL=DEBUG AUTO_CONCURRENCY=1,2,4 BENCH_INTERLEAVED=1 BENCH_ARGS="--rounds 3 --requests-per-slot 16" bash bench/h200_hot_path.sh autodemo > $D/demo_$i.log 2>&1; tail -15 $D/demo_$i.log; done
cd $D && ls -R | head -50
