#!/bin/bash
# Side by side: osu_sign_allreduce (majority, with the float32 all-reduce of the same elements
# in the same job) on the code of several checkouts, alternating, ROUNDS rounds.
# Ran at commit 25bbe30 as results/small_packed/side_by_side.sh (output: results/small_packed/).
# usage: small_packed_side_by_side.sh RANKS ROUNDS OUTDIR TREE...    (env: BITCOLL_SHM=0 for TCP loopback)
# The first size (256 elements) only warms the job up (the first size measured in a job
# runs slow on either side); small_packed_summarize.py leaves it out.
# Every tree runs this checkout's bench/osu_sign_allreduce.py with PYTHONPATH=TREE.
set -eu
ranks=$1; rounds=$2; outdir=$3; shift 3
here=$(cd "$(dirname "$0")/../.." && pwd)
py=${PYTHON:-python3}
mkdir -p "$outdir"
outdir=$(cd "$outdir" && pwd)
for r in $(seq 1 "$rounds"); do
  for tree in "$@"; do
    name=$(basename "$tree")
    echo "# round $r tree $name ranks $ranks shm ${BITCOLL_SHM:-1}" >&2
    (cd "$tree" && PYTHONPATH="$tree" NUMBA_NUM_THREADS=1 timeout 600 \
      "$py" -m launch -n "$ranks" --no-prefix "$here/bench/osu_sign_allreduce.py" \
      -m 256,1K,4K,16K,64K,256K,1M -i 200 -x 20 --compare-float32 --metrics \
      --json "$outdir/${name}_np${ranks}_r${r}.json") > "$outdir/${name}_np${ranks}_r${r}.txt"
  done
done
