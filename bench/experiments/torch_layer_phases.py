"""Where the torch layer's time goes within one synchronous ``dist.all_reduce`` of a float32
tensor on the "bitcoll" backend, by phase, and how much CPU each thread of rank 0 spends per
call. Rank 0 prints, per size, the median microseconds of each phase over 500 calls::

    python -m launch -n 2 bench/experiments/torch_layer_phases.py 8,1048576,8388608

Phases: torch's front end up to the backend's lean path (``enter``), the lean path up to the
Communicator's all-reduce (``to comm``), the all-reduce itself (``comm``), back to the end of
the lean path (``from comm``) and back to the caller (``return``). Then the CPU time of each
thread of the rank (``/proc/self/task``) per call over 500 more calls.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import bitcoll.torch as bt

CALLS = 500


def _thread_cpu() -> dict[int, tuple[str, float]]:
    """Per thread of this process: its name and CPU seconds (user + system)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[int, tuple[str, float]] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended
            continue
        out[int(tid)] = (names.get(int(tid), f"thread {tid}"),
                         (int(fields[11]) + int(fields[12])) / tick)
    return out


def main(argv: list[str]) -> int:
    sizes = [int(s) for s in (argv[0] if argv else "8,1048576").split(",")]
    dist.init_process_group("bitcoll")
    comm = bt.communicator_of()
    stamps = [0.0] * 6
    clock = time.perf_counter
    lean = bt.BitcollProcessGroup._lean_allreduce
    plain = comm.allreduce

    def timed_lean(self: Any, *args: Any) -> Any:
        stamps[1] = clock()
        try:
            return lean(self, *args)
        finally:
            stamps[4] = clock()

    def timed_comm(*args: Any, **kwargs: Any) -> Any:
        stamps[2] = clock()
        try:
            return plain(*args, **kwargs)
        finally:
            stamps[3] = clock()

    bt.BitcollProcessGroup._lean_allreduce = timed_lean  # type: ignore[method-assign,assignment]
    comm.allreduce = timed_comm  # type: ignore[method-assign]
    try:
        if dist.get_rank() == 0:
            print(f"# {dist.get_world_size()} ranks, torch {torch.__version__}; median us per "
                  f"call over {CALLS} calls")
            print("# bytes       enter   to comm      comm  from comm    return")
        for nbytes in sizes:
            t = torch.zeros(max(1, nbytes // 4))
            for _ in range(50):
                dist.all_reduce(t)
            rows = []
            for i in range(CALLS):
                if i % 100 == 0:
                    dist.barrier()
                stamps[0] = clock()
                dist.all_reduce(t)
                stamps[5] = clock()
                rows.append(np.diff(stamps))
            med = np.median(np.array(rows), axis=0) * 1e6
            dist.barrier()
            before = _thread_cpu()
            for _ in range(CALLS):
                dist.all_reduce(t)
            after = _thread_cpu()
            if dist.get_rank() == 0:
                print(f"{nbytes:<10d}" + "".join(f"{v:10.1f}" for v in med), flush=True)
                for tid, (name, secs) in sorted(after.items()):
                    spent = secs - before.get(tid, (name, 0.0))[1]
                    if spent > 0:
                        print(f"#   thread {name}: {spent / CALLS * 1e6:.0f} us CPU per call",
                              flush=True)
    finally:
        bt.BitcollProcessGroup._lean_allreduce = lean  # type: ignore[method-assign]
        comm.allreduce = plain  # type: ignore[method-assign]
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
