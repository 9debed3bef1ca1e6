# Call 3 (code 7f146de, same machine, 13:31-13:32 UTC): issue 11's forward, engine step and full-stack `never` at
# 1, 8 and 64 requests with the spin on (predictions: ../gpu_2026-12-07_session64/next_calls.md, section 2)
export NCCL_NVLS_ENABLE=0 PYTHONPATH=. D=$OUT TANDEM_CACHE_DIR=$PWD/build/spin_cache; nvidia-smi -L > $D/gpu.txt
OUT=$D/i11 DEADLINE_S=420 STACK_CONCURRENCY=1,8,64 bash bench/h200_hot_path.sh forward engine stack > $D/i11.log 2>&1
grep "== \|ms per step\|    1     1\|   64     1" $D/i11.log | head -40; cd $D && tar czf all.tgz i11 i11.log && rm -rf i11; ls
