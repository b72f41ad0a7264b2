"""One script, any launcher: `python -m launch -n N` (TCP) or `mpiexec -n N python` (MPI)."""

import numpy as np

import bitcoll

with bitcoll.init(timeout=60) as comm:
    p, r = comm.size, comm.rank
    total = comm.allreduce(np.full(5, r + 1, np.float32))
    assert np.all(total == p * (p + 1) / 2), total
    votes = comm.sign_allreduce(np.array([1.0, -1.0, (-1.0) ** r], np.float32), tie="positive")
    assert votes.dtype == np.int8 and list(votes[:2]) == [1, -1], votes
    comm.barrier()
    print(f"rank {r}/{p} backend={comm.backend} ok", flush=True)
