#!/bin/bash
cd /work/main
export PATH=/tmp/fresh34/.venv/bin:$PATH
for i in 1 2 3 4 5; do
  for dir in /tmp/ec4 /tmp/bd88 /work/main; do
    echo "== $dir round $i"; OMP_NUM_THREADS=1 PYTHONPATH=$dir python bench/target_step.py --iters 300 --host-part 2>&1 | tail -2
  done
done
