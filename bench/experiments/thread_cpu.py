"""Where the CPU of a 64 MiB in-place all-reduce goes, per thread (/proc/self/task utime and
stime, 12 calls after 3 warm-up calls), printed by every rank.

Run: ``python bench/netbed.py --hosts 4 --rate 10gbit bench/experiments/thread_cpu.py``.
Ran at commit ea10c13 as ``results/paired/thread_cpu.py`` (output: ``results/paired/``).
"""

from __future__ import annotations

import os
import time

import numpy as np

import bitcoll

CALLS = 12


def snap() -> dict[tuple[str, str], tuple[int, int]]:
    """utime and stime, in clock ticks, of every thread of this process."""
    out: dict[tuple[str, str], tuple[int, int]] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                st = f.read()
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue
        fields = st.rsplit(")", 1)[1].split()
        out[(tid, name)] = (int(fields[11]), int(fields[12]))
    return out


def main() -> None:
    comm = bitcoll.init()
    x = np.zeros((64 << 20) // 4, np.float32)
    for _ in range(3):
        comm.allreduce(x, out=x)
    comm.barrier()
    a = snap()
    t = time.perf_counter()
    for _ in range(CALLS):
        comm.allreduce(x, out=x)
    wall = time.perf_counter() - t
    b = snap()
    tick = os.sysconf("SC_CLK_TCK")
    lines = []
    for k in b:
        if k in a:
            du = (b[k][0] - a[k][0]) / tick / CALLS * 1e3
            ds = (b[k][1] - a[k][1]) / tick / CALLS * 1e3
            if du + ds > 0.2:
                who = "MAIN" if int(k[0]) == os.getpid() else k[0]
                lines.append(f"{who:>8} user {du:6.2f} sys {ds:6.2f} ms/call")
    print(f"rank {comm.rank} wall {wall / CALLS * 1e3:.1f} ms/call\n" + "\n".join(lines),
          flush=True)
    comm.close()


if __name__ == "__main__":
    main()
