#!/bin/bash
# 4 ranks on this 2-core machine (oversubscribed), shared memory: this commit against an older
# checkout (OLD, the commit before waiters spun less on oversubscribed hosts), interleaved.
# usage (from the repository root): bench/experiments/shm_oversubscribed.sh OLD > results/shm_small/oversubscribed.txt
# Ran at commit a40806a as results/shm_small/oversubscribed.sh; its raw outputs stay in results/shm_small/.
export NUMBA_NUM_THREADS=1
A="bench/osu_allreduce.py --inplace -m 8,64K,256K,1M -i 1000 -x 100"
for r in 1 2 3; do
  echo "# round $r, this commit: size, latency (us)"
  .venv/bin/python -m launch -n 4 --no-prefix --output-ranks 0 $A 2>&1 | grep -v '^#' | awk '{print $1, $2}'
  echo "# round $r, $1: size, latency (us)"
  (cd "$1" && PYTHONPATH="$1" "$OLDPWD/.venv/bin/python" -m launch -n 4 --no-prefix --output-ranks 0 $A 2>&1 | grep -v '^#' | awk '{print $1, $2}')
done
