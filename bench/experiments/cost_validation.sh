#!/usr/bin/env bash
# The cost model's validation campaign on the emulated testbed (results/cost_model/validation):
# 2, 3, 4 and 2x4 hosts at 1 and 10 Gbit, one measurement at a time.
#   bench/experiments/cost_validation.sh OUT_DIR COLLECTIVE[,COLLECTIVE]   (packed, allreduce)
# With PROBED=1 the model is first measured on the testbed at each link rate
# (python -m bitcoll.probe on 2 hosts of one rank, written to OUT_DIR/model_<rate>.json) and the
# validation uses it as measured; otherwise the default model with the nominal link rate.
set -euo pipefail
out=$1; collectives=${2:-packed,allreduce}
here=$(cd "$(dirname "$0")/../.." && pwd)
py=$here/.venv/bin/python
mkdir -p "$out"
cd "$here"
for c in ${collectives//,/ }; do
  for rate in 1gbit 10gbit; do
    link=(--link "$rate")
    if [ "${PROBED:-0}" = 1 ]; then
      export BITCOLL_COST_MODEL=$out/model_$rate.json
      [ -f "$BITCOLL_COST_MODEL" ] || "$py" bench/netbed.py --hosts 2 --nproc-per-host 1 \
        --rate "$rate" -m bitcoll.probe > "$out/probe_$rate.txt" 2>&1
      link=()
    fi
    for shape in 2x1 3x1 4x1 2x4; do
      h=${shape%x*}; l=${shape#*x}
      # the share of a core of the hosts on the busiest core (3 hosts on 2 cores: 0.5)
      cores=$("$py" -c "print(min(1.0, 1 / -(-$h // 2)))")
      "$py" bench/netbed.py --hosts "$h" --nproc-per-host "$l" --rate "$rate" \
        bench/cost_validate.py "${link[@]}" --host-cores "$cores" --collective "$c" \
        -m 8,4K,64K,256K,1M,16M,256M > "$out/h${shape}_${rate}_${c}.txt" 2>&1
    done
  done
done
