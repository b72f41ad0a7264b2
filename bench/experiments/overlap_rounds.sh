#!/usr/bin/env bash
# Overlap on loopback: train.py with and without --overlap, interleaved rounds.
# Usage: bash bench/experiments/overlap_rounds.sh ROUNDS   (from the repository root)
# Ran at commit 37242f9 as results/overlap/run_rounds.sh; its raw outputs stay in results/overlap/.
set -euo pipefail
rounds=${1:-3}
out=results/overlap
common=(--model small --batch-size 2 --seq-len 64 --steps 15 --eval-every 0 --eval-batches 1
        --optimizer lioncub-l1)
for r in $(seq 1 "$rounds"); do
  for mode in plain overlap; do
    extra=()
    [ "$mode" = overlap ] && extra=(--overlap)
    NUMBA_NUM_THREADS=1 .venv/bin/python -m launch -n 2 --no-prefix --output-ranks 0 train.py \
      "${common[@]}" "${extra[@]}" --json-log "$out/${mode}_round$r.json" > "$out/${mode}_round$r.txt"
  done
done
.venv/bin/python - "$out" "$rounds" <<'PY'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
for mode in ("plain", "overlap"):
    means = []
    for r in range(1, rounds + 1):
        steps = json.load(open(f"{out}/{mode}_round{r}.json"))["steps"]
        times = [s["time"] for s in steps if not s.get("warmup")][2:]
        means.append(statistics.mean(times) * 1e3)
    print(f"{mode:8s} mean step ms per round: " + ", ".join(f"{m:.1f}" for m in means)
          + f"  best {min(means):.1f}")
PY
