"""bitcoll inside an mpi4py program, on the program's own communicators.

An MPI application keeps its own communicators; ``bitcoll.init(comm=...)`` builds a bitcoll
communicator on a private duplicate of any of them, so bitcoll's messages never mix with the
application's. Here the even and the odd ranks each form a group; each group takes a majority
vote of its ranks' signs with bitcoll, and the application checks it with plain mpi4py.

    mpiexec -n 4 python examples/mpi4py_embedding.py
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

import bitcoll


def main() -> None:
    world = MPI.COMM_WORLD
    group = world.Split(color=world.rank % 2, key=world.rank)    # the application's own
    with bitcoll.init(comm=group) as comm:                       # bitcoll on a duplicate
        assert (comm.rank, comm.size, comm.backend) == (group.rank, group.size, "mpi")
        x = np.random.default_rng(world.rank).standard_normal(10_001).astype(np.float32)
        vote = comm.sign_allreduce(x, op="sum")                  # int32: exact sum of signs
        ref = np.zeros_like(vote)
        group.Allreduce(np.sign(x).astype(np.int32), ref, op=MPI.SUM)   # the same, by hand
        assert np.array_equal(vote, ref)
        total = world.allreduce(1)                               # the world is untouched
    group.Free()
    if world.rank == 0:
        print(f"{total} ranks in {min(total, 2)} groups: bitcoll's sums match mpi4py's")


if __name__ == "__main__":
    main()
