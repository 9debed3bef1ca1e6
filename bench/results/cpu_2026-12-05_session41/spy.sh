cd /work/main
export PATH=/tmp/fresh34/.venv/bin:$PATH
out=/tmp/s41/spy${1:-}; rm -rf $out; mkdir -p $out
bash bench/serve_and_run.sh $out "
python3 -m tandem.cli bench --url http://127.0.0.1:\$SERVE_PORT --concurrency 1 --modes always --max-tokens 128 --requests-per-slot 150 --out $out/always > $out/bench.log 2>&1 &
sleep 12
ps -eo pid,args | grep 'tandem.cli' | grep -v grep > $out/ps.txt
for name in gateway target draft; do
  pid=\$(pgrep -f \"tandem.cli \$name\" | head -1)
  py-spy record -p \$pid -d 15 -r 500 --threads --format raw -o $out/\$name.txt > $out/spy_\$name.log 2>&1 &
done
wait
" > $out/run.log 2>&1
echo done > $out/done
