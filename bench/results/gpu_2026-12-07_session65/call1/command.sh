# Call 1 (kind left out; ran on nvidia-h100-x1, NVIDIA H100 80GB HBM3), code c75739b, 11:43-11:48 UTC.
# From the repo root, bench/results/ moved out of the tree, carry ["build/spin_cache", ".whl"].
export NCCL_NVLS_ENABLE=0 PYTHONPATH=. D=$OUT TANDEM_CACHE_DIR=$PWD/build/spin_cache; nvidia-smi -L > $D/gpu.txt
arm() { OUT=$D/t DEADLINE_S=$(($2-SECONDS)) TIMELINE_CONCURRENCY=$3 TIMELINE_TRACKS=scale TIMELINE_TAG=c$3_$1_$4 \
  DRAFT_EXTRA=$([ $1 = push ] && echo --catch-up-on-push) bash bench/h200_hot_path.sh timeline > $D/c$3_$1_$4.log 2>&1
  grep "  round  " $D/c$3_$1_$4.log; }
arm off 130 1 1; arm push 210 1 1; arm off 290 1 2; arm push 370 1 2; arm off 470 8 1; arm push 570 8 1
cd $D && mkdir -p logs && mv c*_*.log logs/ && tar czf all.tgz t logs && rm -rf t logs; ls
