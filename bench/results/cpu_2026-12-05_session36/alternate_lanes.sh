cd /work/main
export PATH=/tmp/fresh34/.venv/bin:$PATH
for r in 1 2; do
  for v in lane grpc; do
    flag=""; [[ $v == grpc ]] && flag="--no-step-lane"
    out=/tmp/s36/lanebench/${v}_$r; rm -rf $out; mkdir -p $out/tl
    TANDEM_TIMELINE=$out/tl BENCH_ARGS="--requests-per-slot 24" bash bench/serve_and_bench.sh $out 1 always,never 128 $flag > $out/run.log 2>&1
    python bench/round_timeline.py $out/tl > $out/timeline.txt 2>&1
  done
done
