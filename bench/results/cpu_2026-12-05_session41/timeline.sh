# usage: timeline.sh TAG [serve flags]: one request, always then never, demo pair on CPU, hop marks
cd /work/main
export PATH=/tmp/fresh34/.venv/bin:$PATH
tag=$1; shift
out=/tmp/s41/tl_$tag; rm -rf $out; mkdir -p $out/tl
TANDEM_TIMELINE=$out/tl BENCH_ARGS="--requests-per-slot 12" bash bench/serve_and_bench.sh $out 1 always,never 128 "$@" > $out/run.log 2>&1
python bench/round_timeline.py $out/tl > $out/timeline.txt 2>&1
echo done > $out/done
