"""Under ``mpiexec -n N``: rank 2 stops itself (SIGSTOP) after a first collective; the others
wait for it in the next collective with a short deadline, catch the CommError, print a marker
and exit normally. MPI_Finalize would then wait for the stopped rank forever; the transport's
exit rule must end the job instead.

``python mpi_sigstop.py TIMEOUT``: the communicator's deadline in seconds (default 3).
"""

from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np
from mpi_marks import mark

import bitcoll
from bitcoll.errors import CommError

STOPPED_RANK = 2


def main() -> None:
    timeout = float(sys.argv[1]) if len(sys.argv) > 1 else 3.0
    comm = bitcoll.init("mpi", timeout=timeout)
    comm.allreduce(np.ones(4, np.float32))
    mark(f"READY rank={comm.rank} pid={os.getpid()}")
    comm.barrier()
    if comm.rank == STOPPED_RANK:
        os.kill(os.getpid(), signal.SIGSTOP)
    start = time.monotonic()
    try:
        comm.allreduce(np.ones(100_000, np.float32))
    except CommError as exc:
        waited = time.monotonic() - start
        mark(f"CAUGHT rank={comm.rank} after={waited:.2f} {type(exc).__name__}: {exc}")
    comm.close()
    mark(f"EXITING rank={comm.rank}")


if __name__ == "__main__":
    main()
