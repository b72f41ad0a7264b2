"""Count the samples of ``perf script`` whose leaf is one of LEAFS by the DEPTH frames above it.

Run: ``python bench/experiments/kernel_profile_stacks.py PERF.DATA LEAF[,LEAF...] DEPTH [ROWS]``.
Ran at commit e796d13 as ``results/paired/kernel_profile_stacks.py`` (output:
``results/paired/``).
"""

from __future__ import annotations

import collections
import subprocess
import sys


def main(argv: list[str]) -> None:
    data, leafs, depth = argv[0], argv[1].split(","), int(argv[2])
    rows = int(argv[3]) if len(argv) > 3 else 15
    out = subprocess.run(["perf", "script", "-i", data, "-F", "comm,tid,ip,sym"],
                         capture_output=True, text=True, check=True).stdout
    counts: collections.Counter[tuple[str, ...]] = collections.Counter()
    total = 0
    for block in out.split("\n\n"):
        lines = [line.strip() for line in block.strip().splitlines()]
        if len(lines) < 2:
            continue
        frames = [line.split(None, 1)[1] if " " in line else line for line in lines[1:]]
        total += 1
        if frames[0] in leafs:
            counts[(lines[0].split()[0], *frames[1:1 + depth])] += 1
    print("total", total)
    for key, n in counts.most_common(rows):
        print(n, " <- ".join(key))


if __name__ == "__main__":
    main(sys.argv[1:])
