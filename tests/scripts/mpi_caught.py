"""Under ``mpiexec -n N``: deliberate communication failures that the program catches (a
mismatched collective: every rank fails at once; a collective rank 0 skips: the others time
out), then more collectives on a fresh communicator and a normal exit. The job must exit 0.
"""

from __future__ import annotations

import numpy as np
from mpi_marks import mark

import bitcoll
from bitcoll.errors import CommError, CommTimeoutError, UsageError


def main() -> None:
    with bitcoll.init("mpi", timeout=60.0) as comm:
        rank, size = comm.rank, comm.size
        odd = rank == size - 1
        try:
            comm.allreduce(np.ones(100 + odd, np.float32))  # lengths differ: a ProtocolError
        except (CommError, UsageError) as exc:
            mark(f"MISMATCH rank={rank} {type(exc).__name__}")
        else:
            raise AssertionError("the mismatched allreduce succeeded")

    with bitcoll.init("mpi", timeout=2.0) as comm:
        if rank != 0:  # rank 0 skips the barrier: the others time out (or hear of a timeout)
            try:
                comm.barrier()
            except CommError as exc:
                timed_out = isinstance(exc, CommTimeoutError) or "CommTimeoutError" in str(exc)
                assert timed_out, exc
                mark(f"TIMEOUT rank={rank} {type(exc).__name__}")
            else:
                raise AssertionError("the barrier without rank 0 succeeded")

    with bitcoll.init("mpi", timeout=60.0) as comm:
        total = comm.allreduce(np.full(8, rank + 1, np.float32))
        assert np.all(total == size * (size + 1) / 2), total
        comm.barrier()
    mark(f"DONE rank={rank}")


if __name__ == "__main__":
    main()
