"""Summarize the cost model's validation campaign (bench/experiments/cost_validation.sh): per
file and size, the planner's pick, its predicted / measured time and its measured time over the
fastest algorithm measured (``!`` outside 15% and 5%), then the counts.

    python bench/experiments/cost_validation_summary.py results/cost_model/validation
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

_ROW = re.compile(r"^(?:\[rank 0\] )?(\d+)\s+(\w+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s*([*+-]*)")


def main(argv: list[str]) -> int:
    folder = Path(argv[0])
    within = good = total = 0
    for path in sorted(folder.glob("h*.txt")):
        sizes: dict[int, dict[str, tuple[float, float, str]]] = {}
        for line in path.read_text().splitlines():
            m = _ROW.match(line.strip())
            if m:
                size, algo, meas, pred, _, mark = m.groups()
                sizes.setdefault(int(size), {})[algo] = (float(meas), float(pred), mark)
        cells = []
        for size, algos in sorted(sizes.items()):
            picks = [a for a, (_, _, mark) in algos.items() if "*" in mark]
            if not picks:
                continue
            meas, pred, _ = algos[picks[0]]
            best = min(v[0] for v in algos.values())
            r, q = pred / meas, meas / best
            total += 1
            within += abs(r - 1) <= 0.15
            good += q <= 1.05
            cells.append(f"{size}:{picks[0][:4]} {r:.2f}{'!' if abs(r - 1) > 0.15 else ''}"
                         f"/{q:.2f}{'!' if q > 1.05 else ''}")
        print(f"{path.stem:24s} " + "  ".join(cells))
    print(f"picks within 15%: {within}/{total}; pick within 5% of best: {good}/{total}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
