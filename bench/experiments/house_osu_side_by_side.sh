#!/usr/bin/env bash
# Small-message all-reduce latency (8 B-64 KiB, float32 sum, 2 ranks) of two checkouts side by
# side, alternating per round: TCP (BITCOLL_SHM=0), shared memory, and MPI (mpiexec).
#   bench/experiments/house_osu_side_by_side.sh BEFORE_TREE AFTER_TREE OUT_DIR ROUNDS
set -euo pipefail
before=$1; after=$2; out=$3; rounds=${4:-3}
here=$(cd "$(dirname "$0")/../.." && pwd)
py=$here/.venv/bin/python
mkdir -p "$out"
osu=(bench/osu_allreduce.py --inplace -m 8,64,1K,8K,64K -i 2000 -x 200 --min-iterations 200)
for r in $(seq 1 "$rounds"); do
  for side in before after; do
    tree=${!side}
    cd "$tree"
    BITCOLL_SHM=0 PYTHONPATH=$tree "$py" -m launch -n 2 --no-prefix --output-ranks 0 \
      "${osu[@]}" --impl bitcoll > "$out/tcp_${side}_r$r.txt"
    BITCOLL_SHM=1 PYTHONPATH=$tree "$py" -m launch -n 2 --no-prefix --output-ranks 0 \
      "${osu[@]}" --impl bitcoll > "$out/shm_${side}_r$r.txt"
    PYTHONPATH=$tree "$here/.venv/bin/mpiexec" -n 2 "$py" "${osu[@]}" --impl bitcoll \
      --backend mpi > "$out/mpi_${side}_r$r.txt"
  done
done
