#!/bin/bash
# Ring against recursive doubling for small all-reduces, 2-5 ranks, shared memory and TCP.
# usage (from the repository root): bench/experiments/small_allreduce.sh > results/small_allreduce/out.txt
# Ran at commit fbcaa00 as results/small_allreduce/run.sh; its raw outputs stay in results/small_allreduce/.
export NUMBA_NUM_THREADS=1
A="bench/osu_allreduce.py --inplace -m 64K,128K,256K,512K,1M -i 1000 -x 100"
for n in 2 3 4 5; do for s in 1 0; do for alg in ring recursive_doubling; do
  echo "# $n ranks, BITCOLL_SHM=$s, --algorithm $alg: size and latency (us)"
  BITCOLL_SHM=$s .venv/bin/python -m launch -n $n --no-prefix --output-ranks 0 $A --algorithm $alg 2>&1 | grep -v '^#'
done; done; done
