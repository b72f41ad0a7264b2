"""Summarise the JSON tables of small_packed_side_by_side.sh: per checkout and size, the median over
rounds of the float32 and majority latencies (same job each round), of their ratio
majority / float32 (lower is better; <= 1: the packed all-reduce is no slower) and of the
process CPU time per call of each (averaged over ranks).

usage: python bench/experiments/small_packed_summarize.py DIR [DIR ...]
(output: results/small_packed/summary.txt; ran at commit 25bbe30 as
results/small_packed/summarize.py)
"""

from __future__ import annotations

import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import osu


def main(dirs: list[str]) -> None:
    for d in dirs:
        runs: dict[tuple[str, str], list[dict[int, tuple[float, ...]]]] = defaultdict(list)
        for path in sorted(Path(d).glob("*.json")):
            m = re.match(r"(.+)_np(\d+)_r(\d+)\.json", path.name)
            if m is None:
                continue
            tables = {t.meta.get("variant", t.title): t for t in osu.load_tables(path)}
            f32 = tables["float32/allreduce"]
            maj = tables["majority/default"]
            col, ecol, cpu = "Avg Latency(us)", "Elements", "CPU(us)"
            row: dict[int, tuple[float, ...]] = {
                int(r[ecol]): (float(r[col]), float(s[col]), float(r[cpu]), float(s[cpu]))
                   for r, s in zip(f32.rows, maj.rows, strict=True)}
            runs[(m.group(1), m.group(2))].append(row)
        print(f"# {d}")
        print(f"# {'tree':<14}{'ranks':>6}{'elements':>10}{'float32 us':>12}"
              f"{'majority us':>13}{'maj/f32':>9}{'f32 CPU':>9}{'maj CPU':>9}{'rounds':>8}")
        for (tree, ranks), rows in sorted(runs.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            for n in sorted(k for k in rows[0] if k >= 1024):  # 256: the warm-up size
                f = [r[n][0] for r in rows]
                g = [r[n][1] for r in rows]
                ratio = [b / a for a, b in zip(f, g, strict=True)]
                print(f"{tree:<16}{ranks:>4}{n:>10}{statistics.median(f):>12.1f}"
                      f"{statistics.median(g):>13.1f}{statistics.median(ratio):>9.2f}"
                      f"{statistics.median(r[n][2] for r in rows):>9.0f}"
                      f"{statistics.median(r[n][3] for r in rows):>9.0f}"
                      f"{len(rows):>8}")


if __name__ == "__main__":
    main(sys.argv[1:])
