"""bitcoll's all-reduce over MPI against mpi4py's ``Allreduce``, by how the caller passes its
arrays, and MPI's own collectives called raw (what bitcoll's path costs without Python).
Rank 0 prints, per size, the best of 7 rounds of each loop (microseconds per call) and, for
bitcoll's, its ratio to mpi4py's::

    mpiexec -n 2 python bench/experiments/mpi_array_reuse.py 8,512,8192,65536,262144

bitcoll's loops: ``same`` (``allreduce(x, out=y)``, the same two arrays each call), ``inplace``
(``allreduce(z, out=z)``), ``fresh`` (``allreduce(x)``: a new result array each call) and
``twod`` (a 2-D array in place). The raw loops, on a private duplicate of ``COMM_WORLD``:
``Iallreduce`` polled with ``Test`` (``raw_iallreduce``), a persistent ``Allreduce_init``
started and polled (``raw_persistent``), and a persistent 32-byte-per-rank ``Allgather_init``
followed by that persistent all-reduce (``raw_check_then_persistent``: bitcoll's two
collectives with no Python around them). Float32 sums (of zeros where in place).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import numpy as np
from mpi4py import MPI

import bitcoll

ROUNDS = 7


def _spin(req: MPI.Request) -> None:
    while not req.Test():
        pass


def _loops(comm: bitcoll.Communicator, dup: MPI.Intracomm, nbytes: int
           ) -> tuple[dict[str, Callable[[], object]], list[MPI.Prequest]]:
    n = max(1, nbytes // 4)
    x = np.ones(n, np.float32)
    y = np.zeros(n, np.float32)
    z = np.zeros(n, np.float32)  # in place: zeros stay zeros
    square = np.zeros((2, n // 2) if n > 1 else (1, 1), np.float32)
    rec = np.zeros(32, np.uint8)
    recs = np.zeros(32 * dup.Get_size(), np.uint8)
    persistent = dup.Allreduce_init([x, MPI.FLOAT], [y, MPI.FLOAT], MPI.SUM)
    gather = dup.Allgather_init([rec, MPI.BYTE], [recs, MPI.BYTE])

    def iallreduce() -> None:
        _spin(dup.Iallreduce([x, MPI.FLOAT], [y, MPI.FLOAT], MPI.SUM))

    def start(req: MPI.Prequest) -> None:
        req.Start()
        _spin(req)

    def both() -> None:
        start(gather)
        start(persistent)

    loops: dict[str, Callable[[], object]] = {
        "mpi4py": lambda: MPI.COMM_WORLD.Allreduce(x, y),
        "same": lambda: comm.allreduce(x, out=y),
        "inplace": lambda: comm.allreduce(z, out=z),
        "fresh": lambda: comm.allreduce(x),
        "twod": lambda: comm.allreduce(square, out=square),
        "raw_iallreduce": iallreduce,
        "raw_persistent": lambda: start(persistent),
        "raw_check_then_persistent": both,
    }
    return loops, [persistent, gather]


def main() -> int:
    sizes = [int(s) for s in sys.argv[1].split(",")] if len(sys.argv) > 1 else [8, 65536]
    world = MPI.COMM_WORLD
    dup = world.Dup()
    with bitcoll.init("mpi", timeout=120) as comm:
        if world.rank == 0:
            print(f"# {world.size} ranks, float32 sum, best of {ROUNDS} rounds, us per call; "
                  "(x) = ratio to mpi4py", flush=True)
        for nbytes in sizes:
            loops, requests = _loops(comm, dup, nbytes)
            iters = 2000 if nbytes <= 8192 else 500
            best = dict.fromkeys(loops, float("inf"))
            for _ in range(ROUNDS):
                for name, loop in loops.items():
                    for _ in range(50):
                        loop()
                    world.Barrier()
                    t = time.perf_counter()
                    for _ in range(iters):
                        loop()
                    best[name] = min(best[name], (time.perf_counter() - t) / iters * 1e6)
            for req in requests:
                req.Free()
            if world.rank == 0:
                ref = best["mpi4py"]
                print(f"{nbytes:>7} " + "  ".join(
                    f"{k} {v:.2f}" + (f" ({v / ref:.2f})" if k != "mpi4py" else "")
                    for k, v in best.items()), flush=True)
    dup.Free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
