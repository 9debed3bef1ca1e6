# Call 3 (prepared, not run): where the two kernel goals' time goes today on the H200 (issue 11's forward at batch 1,
# issue 12's draft call at batch 1): the forward's kernels by device time (cuBLAS, then cuBLASLt preferred), and the
# draft call's at batch 1 and 64. Last profiled on an H200 in the eleventh and thirteenth sessions.
export NCCL_NVLS_ENABLE=0 PYTHONPATH=. D=$OUT TANDEM_CACHE_DIR=$PWD/build/spin_cache; nvidia-smi -L > $D/gpu.txt; date -u > $D/start.txt
OUT=$D/k DEADLINE_S=560 bash bench/h200_hot_path.sh kernels draftprofile > $D/k.log 2>&1; echo "== k $(date -u +%T)"; grep "== " $D/k.log
date -u >> $D/start.txt; cd $D && tar czf all.tgz k k.log && rm -rf k k.log; ls
