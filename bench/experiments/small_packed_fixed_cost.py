"""The CPU cost of one call without the transport: a communicator of ``p`` ranks whose
transport completes every frame at once (nothing is sent; receives leave their buffers as
they are), so what is timed is the Python and kernel work of one rank's call alone: the
fixed cost per call the issue is about. Best of 5 loops per row.

usage: PYTHONPATH=<checkout> python bench/experiments/small_packed_fixed_cost.py P
(output: results/small_packed/fixed_cost.txt; ran at commit 25bbe30 as
results/small_packed/fixed_cost.py)
"""

from __future__ import annotations

import functools
import sys
import time
import warnings
from collections.abc import Callable

import numpy as np

from bitcoll.communicator import Communicator
from bitcoll.errors import CommError
from bitcoll.transport.base import FrameHeader, Request, TrafficStats, Transport


class _Done(Request):
    def done(self) -> bool:
        return True

    def wait(self, deadline: float) -> None:
        return None


_DONE = _Done()


class _Instant(Transport):
    """Rank 0 of ``size``: every send and receive is complete when posted."""

    name = "instant"

    def __init__(self, size: int) -> None:
        self.rank, self.size = 0, size
        self.stats = TrafficStats()

    def isend(self, peer: int, payload: memoryview, header: FrameHeader) -> Request:
        return _DONE

    def irecv(self, peer: int, payload: memoryview, header: FrameHeader) -> Request:
        return _DONE

    def abort(self, reason: str) -> None:
        pass

    def close(self) -> None:
        pass

    @property
    def failure(self) -> CommError | None:
        return None


def _best(f: Callable[[], object], n: int) -> float:
    for _ in range(50):
        f()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            f()
        best = min(best, (time.perf_counter() - t0) / n)
    return best * 1e6


def main() -> None:
    p = int(sys.argv[1])
    comm = Communicator(_Instant(p))
    warnings.simplefilter("ignore")  # float32 sums of uninitialised receive buffers
    print(f"# ranks {p}: microseconds per call (best of 5 loops)")
    print(f"# {'elements':>9} {'float32':>9} {'majority':>9} {'allgather':>10} {'direct':>9}")
    for n in (1 << 10, 1 << 14, 1 << 18):
        x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
        o8, y = np.empty(n, np.int8), np.empty(n, np.float32)
        loops = 1000 if n < 100_000 else 100
        cols = [_best(functools.partial(comm.allreduce, x, out=y), loops)]
        for algo in (None, "allgather", "direct"):
            cols.append(_best(functools.partial(comm.sign_allreduce, x, out=o8, algorithm=algo),
                              loops))
        print(f"{n:>11} " + " ".join(f"{c:>9.1f}" for c in cols), flush=True)


if __name__ == "__main__":
    main()
