# Call 1 (code 7f146de, nvidia-h200 asked, NVIDIA H100 80GB HBM3 came, 13:26-13:30 UTC): the timeline at one request
# with the services pinned to disjoint cores against the default, alternated twice, then the verify step's phases
# with features at 1 x 8 and 8 x 8, the feature pick at 0, 1 MiB and 4 MiB (the predictions: ../gpu_2026-12-07_session65/predictions.md).
export NCCL_NVLS_ENABLE=0 PYTHONPATH=. D=$OUT TANDEM_CACHE_DIR=$PWD/build/spin_cache; nvidia-smi -L > $D/gpu.txt
pinall() { while :; do for p in $(pgrep -f "tandem[.]cli target"); do taskset -a -p -c 2-5 $p >/dev/null 2>&1; done
  for p in $(pgrep -f "tandem[.]cli draft"); do taskset -a -p -c 6-9 $p >/dev/null 2>&1; done
  for p in $(pgrep -f "tandem[.]cli gateway"); do taskset -a -p -c 10-13 $p >/dev/null 2>&1; done; sleep 0.2; done; }
arm() { if [ $1 = pin ]; then pinall & P=$!; taskset -p -c 0,1 $P >/dev/null; fi
  OUT=$D/t DEADLINE_S=$(($2-SECONDS)) TIMELINE_CONCURRENCY=1 TIMELINE_TRACKS=scale TIMELINE_TAG=c1_$1_$3 \
    bash bench/h200_hot_path.sh timeline > $D/c1_$1_$3.log 2>&1; [ $1 = pin ] && kill $P
  grep "  round  \|engine.start->target.engine\|synced->target.engine.end\|target.parsed\|gw.scheduled\|draft.parsed" $D/c1_$1_$3.log; }
arm def 130 1; arm pin 215 1; arm def 300 2; arm pin 385 2
for x in 0 1048576 4194304; do timeout 60 python3 bench/engine_step.py --batches 1,8 --nodes 8 --iters 20 \
  --modes graphs --phases --features --feature-pick-bytes $x --out $D/ph_$x.json > $D/ph_$x.log 2>&1
  grep "phases batch" $D/ph_$x.log; done
cd $D && mkdir -p logs && mv c1_*.log ph_* logs/ && tar czf all.tgz t logs && rm -rf t logs; ls
