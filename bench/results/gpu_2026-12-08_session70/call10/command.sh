export NCCL_NVLS_ENABLE=0 PYTHONPATH=. D=$OUT TANDEM_CACHE_DIR=$PWD/build/spin_cache; nvidia-smi -L > $D/gpu.txt; date -u > $D/start.txt
OUT=$D/sp DEADLINE_S=380 SPEC_CONCURRENCY=1,4,16 SPEC_DEMO_CONCURRENCY=1 bash bench/h200_hot_path.sh spec > $D/sp.log 2>&1; echo "== sp $(date -u +%T)"; tail -25 $D/sp.log
date -u >> $D/start.txt; cd $D && tar czf all.tgz sp sp.log && rm -rf sp sp.log; ls
