"""Progress marks of the MPI failure scripts (tests/test_mpi_failures.py reads them)."""

from __future__ import annotations

import os


def mark(text: str) -> None:
    """Print ``text`` and, when MPI_TEST_MARKS names a directory, append it to a file there
    (mpiexec's output forwarding may drop the last lines of a rank that is being killed)."""
    print(text, flush=True)
    folder = os.environ.get("MPI_TEST_MARKS")
    if folder:
        with open(os.path.join(folder, f"{os.getpid()}.txt"), "a") as f:
            f.write(text + "\n")
