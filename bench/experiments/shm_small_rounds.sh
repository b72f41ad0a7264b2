#!/bin/bash
# Interleaved rounds: small and mid-size all-reduces over shared memory (this commit and the
# commit before shared-memory receives progressed on the calling thread, checked out at OLD),
# over loopback TCP and with torch gloo. Raw outputs next to this script.
# usage (from the repository root): bench/experiments/shm_small_rounds.sh FIRST LAST OLD_CHECKOUT
# Ran at commit 0cb64d9 as results/shm_small/run_rounds.sh; its raw outputs stay in results/shm_small/.
set -u
OUT=$PWD/results/shm_small
OLD=$3
export NUMBA_NUM_THREADS=1
PY=$PWD/.venv/bin/python
A="bench/osu_allreduce.py --inplace -m 8,64K,256K,1M,4M -i 2000 -x 200"
run() {  # name file dir env... -- args...
  local name=$1 f=$2 dir=$3; shift 3
  local envs=(); while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  echo "# $(date -Is) load $(cut -d' ' -f1 /proc/loadavg): ${envs[*]} $*" > "$f"
  (cd "$dir" && env "${envs[@]}" timeout 600 "$PY" -m launch "$@" >> "$f" 2>&1)
  grep -v '^#' "$f" | grep . | sed "s/^/$name: /"
}
for r in $(seq "$1" "$2"); do
  for n in 2 4; do
    run "np$n shm r$r" $OUT/np${n}_shm_r$r.txt "$PWD" BITCOLL_SHM=1 -- -n $n --no-prefix --output-ranks 0 $A
    run "np$n shm-before r$r" $OUT/np${n}_shm_before_r$r.txt "$OLD" BITCOLL_SHM=1 PYTHONPATH=$OLD -- -n $n --no-prefix --output-ranks 0 $A
    run "np$n tcp r$r" $OUT/np${n}_tcp_r$r.txt "$PWD" BITCOLL_SHM=0 -- -n $n --no-prefix --output-ranks 0 $A
    run "np$n gloo r$r" $OUT/np${n}_gloo_r$r.txt "$PWD" BITCOLL_SHM=0 -- -n $n --no-prefix --output-ranks 0 $A --impl gloo
  done
done
