"""Under ``mpiexec -n N``: rank 2 raises an uncaught exception after a first collective while
the others wait in the next one (300 s deadline). The whole job must end within seconds.

``python mpi_uncaught.py with``: the communicator is used as a context manager (closed on the
way out, as in the README); ``plain``: it is left open (the exit hook finds it live).
"""

from __future__ import annotations

import os
import sys

import numpy as np
from mpi_marks import mark

import bitcoll

FAILING_RANK = 2


def run(comm: bitcoll.Communicator) -> None:
    total = comm.allreduce(np.ones(4, np.float32))
    assert np.all(total == comm.size), total
    mark(f"READY rank={comm.rank} pid={os.getpid()}")
    comm.barrier()  # every rank has written its marker before rank 2 fails
    if comm.rank == FAILING_RANK:
        raise RuntimeError(f"deliberate failure on rank {comm.rank}")
    comm.allreduce(np.ones(1000, np.float32))  # rank 2 never joins: waits for the deadline
    mark(f"UNREACHABLE rank={comm.rank}")


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "with"
    if mode == "with":
        with bitcoll.init("mpi", timeout=300.0) as comm:
            run(comm)
    else:
        run(bitcoll.init("mpi", timeout=300.0))


if __name__ == "__main__":
    main()
