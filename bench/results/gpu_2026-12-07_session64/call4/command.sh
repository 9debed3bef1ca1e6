export NCCL_NVLS_ENABLE=0 PYTHONPATH=. D=$OUT TANDEM_CACHE_DIR=$PWD/build/spin_cache; cc --version | head -1; nvidia-smi -L
timeout 60 python3 bench/host_wake.py --samples 120 > $D/host_wake.log 2>&1; cat $D/host_wake.log
arm() { OUT=$D/t DEADLINE_S=$(($2-SECONDS)) TANDEM_LANE_SPIN_US=$([ $1 = 0 ] && echo 0 || echo 20000) TANDEM_LANE_SPIN_NATIVE=$([ $1 = py ] && echo 0 || echo 1) TIMELINE_CONCURRENCY=$3 TIMELINE_TRACKS=scale TIMELINE_TAG=c$3_$1_$4 bash bench/h200_hot_path.sh timeline > $D/c$3_$1_$4.log 2>&1; grep "  round  " $D/c$3_$1_$4.log; }
arm 0 330 1 1; arm c 330 1 1; arm 0 330 1 2; arm c 330 1 2; arm py 400 1 1; arm 0 480 8 1; arm c 560 8 1; mv $D/host_wake.log $D/t/; ls $D/t
