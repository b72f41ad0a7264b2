"""Summarize bench/experiments/house_osu_side_by_side.sh: per transport and size, the median
over rounds of each side's average latency (us) and after/before.

    python bench/experiments/house_osu_summarize.py OUT_DIR
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path


def _table(path: Path) -> dict[int, float]:
    rows: dict[int, float] = {}
    for line in path.read_text().splitlines():
        cols = line.split()
        if len(cols) >= 2 and cols[0].isdigit():
            rows[int(cols[0])] = float(cols[1])
    return rows


def main(out: str) -> int:
    root = Path(out)
    print(f"{'transport':<10}{'size':>8}{'before us':>12}{'after us':>12}{'after/before':>14}")
    for transport in ("tcp", "shm", "mpi"):
        sides: dict[str, dict[int, list[float]]] = {"before": {}, "after": {}}
        for side, sizes in sides.items():
            for f in sorted(root.glob(f"{transport}_{side}_r*.txt")):
                for size, us in _table(f).items():
                    sizes.setdefault(size, []).append(us)
        for size in sorted(sides["before"]):
            b = statistics.median(sides["before"][size])
            a = statistics.median(sides["after"].get(size, [float("nan")]))
            print(f"{transport:<10}{size:>8}{b:>12.1f}{a:>12.1f}{a / b:>14.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
