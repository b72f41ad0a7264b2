#!/bin/bash
# Interleaved rounds of the shared-memory benchmarks; raw outputs next to this script.
# usage (from the repository root): bench/experiments/shm_rounds.sh FIRST_ROUND LAST_ROUND
# Ran at commit fde6adf as results/shm/run_rounds.sh; its raw outputs stay in results/shm/.
set -u
OUT=results/shm
export NUMBA_NUM_THREADS=1
PY=.venv/bin/python
run() {  # name file env... -- command...
  local name=$1 f=$2; shift 2
  local envs=(); while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  echo "# $(date -Is) load $(cut -d' ' -f1 /proc/loadavg): ${envs[*]} $*" > "$f"
  env "${envs[@]}" timeout 600 "$@" >> "$f" 2>&1
  grep -v '^#' "$f" | grep . | sed "s/^/$name: /"
}
for r in $(seq "$1" "$2"); do
  A="bench/osu_allreduce.py -m 16M,64M,256M"
  run "shm r$r" $OUT/allreduce_np2_shm_round$r.txt BITCOLL_SHM=1 -- $PY -m launch -n 2 --no-prefix $A
  run "tcp r$r" $OUT/allreduce_np2_tcp_round$r.txt BITCOLL_SHM=0 -- $PY -m launch -n 2 --no-prefix $A
  run "gloo r$r" $OUT/allreduce_np2_gloo_round$r.txt BITCOLL_SHM=0 -- $PY -m launch -n 2 --no-prefix $A --impl gloo
  run "shm-ring r$r" $OUT/allreduce_np2_shm_ring_only_round$r.txt BITCOLL_SHM=1 -- $PY -m launch -n 2 --no-prefix results/shm/ring_only.py $A
  S="bench/osu_sign_allreduce.py -m 64M"
  run "sign shm r$r" $OUT/sign_np4_shm_round$r.txt BITCOLL_SHM=1 -- $PY -m launch -n 4 --no-prefix $S
  run "sign tcp r$r" $OUT/sign_np4_tcp_round$r.txt BITCOLL_SHM=0 -- $PY -m launch -n 4 --no-prefix $S
done
