"""User and system CPU time (os.times) and context switches (getrusage) per call of a 64 MiB
in-place all-reduce, bitcoll and gloo in one job, 4 alternating rounds of 8 calls, medians.

Run: ``python bench/netbed.py --hosts 4 --rate 10gbit bench/experiments/user_sys.py [BYTES]``.
Ran at commit ea10c13 as ``results/paired/user_sys.py`` (output: ``results/paired/``).
"""

from __future__ import annotations

import os
import resource
import sys
import time

import numpy as np
import osu
import osu_allreduce

ROUNDS = 4
CALLS = 8


def main(argv: list[str]) -> None:
    rt = osu.BitcollRuntime()
    ref = osu.open_runtime("gloo")
    n = (int(argv[0]) if argv else 64 << 20) // 4
    rows = {}
    for side in (rt, ref):
        x = np.zeros(n, np.float32)
        y = np.zeros(n, np.float32)
        op, _ = osu_allreduce.make_op(side, x, y, True, "auto")
        rows[side.impl] = (side, op)
    res: dict[str, list[tuple[float, ...]]] = {k: [] for k in rows}
    for r in range(ROUNDS):
        order = list(rows.items()) if r % 2 == 0 else list(rows.items())[::-1]
        for k, (side, op) in order:
            op()
            side.barrier()
            t0, u0 = os.times(), resource.getrusage(resource.RUSAGE_SELF)
            w = time.perf_counter()
            for _ in range(CALLS):
                op()
            w = time.perf_counter() - w
            t1, u1 = os.times(), resource.getrusage(resource.RUSAGE_SELF)
            res[k].append((w / CALLS * 1e3, (t1.user - t0.user) / CALLS * 1e3,
                           (t1.system - t0.system) / CALLS * 1e3,
                           (u1.ru_nvcsw - u0.ru_nvcsw) / CALLS,
                           (u1.ru_nivcsw - u0.ru_nivcsw) / CALLS))
    for k, v in res.items():
        med = np.round(np.median(np.array(v), axis=0), 1)
        print(f"rank {rt.rank} {k}: wall/user/sys ms, vol/invol csw per call (median):", med,
              flush=True)
    ref.close()
    rt.close()


if __name__ == "__main__":
    main(sys.argv[1:])
