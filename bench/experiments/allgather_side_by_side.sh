#!/bin/bash
# Side by side: the default dense all-gather (osu_collectives --collective allgather) on the
# code of two checkouts, alternating, ROUNDS rounds, then a table of the median latency per
# size of each tree and their ratio (files named "before" for the first tree, "after" for the
# second).
# Ran at the commit that made Bruck's all-gather the planner's (output: results/allgather_bruck/).
# usage: allgather_side_by_side.sh RANKS ROUNDS OUTDIR TREE_BEFORE TREE_AFTER
#        (env: BITCOLL_SHM=0 for TCP loopback; SIZES, default 8:16M; COLLECTIVES, default
#        allgather, a comma list for osu_collectives.py; NETBED, e.g. "--hosts 4 --rate 1gbit":
#        run on the emulated testbed instead of one host, RANKS then ranks per host)
# Every tree runs this checkout's bench/osu_collectives.py with PYTHONPATH=TREE.
set -eu
ranks=$1; rounds=$2; outdir=$3; shift 3
here=$(cd "$(dirname "$0")/../.." && pwd)
py=${PYTHON:-python3}
sizes=${SIZES:-8:16M}
collectives=${COLLECTIVES:-allgather}
mkdir -p "$outdir"
outdir=$(cd "$outdir" && pwd)
tag="np${ranks}_shm${BITCOLL_SHM:-1}"
[ -z "${NETBED:-}" ] || tag="netbed_$(echo "$NETBED" | tr -d ' -')_np${ranks}"
[ "$collectives" = allgather ] || tag="${tag}_$(echo "$collectives" | tr ',' '+')"
before=$1; after=$2
for r in $(seq 1 "$rounds"); do
  for name in before after; do
    if [ "$name" = before ]; then tree=$before; else tree=$after; fi
    echo "# round $r tree $name ranks $ranks shm ${BITCOLL_SHM:-1}" >&2
    if [ -n "${NETBED:-}" ]; then
      # shellcheck disable=SC2086  (NETBED is a list of arguments)
      run=("$py" "$here/bench/netbed.py" $NETBED --nproc-per-host "$ranks")
    else
      run=("$py" -m launch -n "$ranks" --no-prefix)
    fi
    (cd "$tree" && PYTHONPATH="$tree" NUMBA_NUM_THREADS=1 timeout 600 \
      "${run[@]}" "$here/bench/osu_collectives.py" \
      --collective "$collectives" -m "$sizes" --metrics \
      --json "$outdir/${name}_${tag}_r${r}.json") > "$outdir/${name}_${tag}_r${r}.txt"
  done
done
"$py" - "$outdir" "$tag" before after <<'PYEOF' | tee "$outdir/summary_${tag}.txt"
import json, statistics, sys
from pathlib import Path
out, tag, before, after = sys.argv[1:5]
def rows(name):
    per = {}
    for f in sorted(Path(out).glob(f"{name}_{tag}_r*.json")):
        doc = json.loads(f.read_text())
        for table in doc:
            coll = table["meta"]["collective"]
            for row in table["rows"]:
                per.setdefault((coll, row["Size"]), []).append(row["Avg Latency(us)"])
    return {k: statistics.median(v) for k, v in per.items()}
b, a = rows(before), rows(after)
print(f"# {tag}: median over rounds of the average latency (us); ratio {after}/{before}")
print(f"{'collective':>14} {'bytes':>10} {before:>12} {after:>12} {'ratio':>7}")
for coll, size in sorted(b):
    if (coll, size) in a:
        print(f"{coll:>14} {size:>10} {b[coll, size]:>12.1f} {a[coll, size]:>12.1f} "
              f"{a[coll, size] / b[coll, size]:>7.2f}")
PYEOF
