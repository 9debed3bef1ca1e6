export NCCL_NVLS_ENABLE=0 PYTHONPATH=. D=$OUT TANDEM_CACHE_DIR=$PWD/build/spin_cache; nvidia-smi -L > $D/gpu.txt; date -u > $D/start.txt
OUT=$D/k DEADLINE_S=280 bash bench/h200_hot_path.sh draftprofile > $D/k.log 2>&1; echo "== k $(date -u +%T)"; grep "== " $D/k.log
date -u >> $D/start.txt; cd $D && tar czf all.tgz k k.log && rm -rf k k.log; ls
