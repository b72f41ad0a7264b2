"""MPICH Allreduce, Iallreduce polled with Test, bitcoll's transport call (native_allreduce,
no argument check) and bitcoll's allreduce, in one job, best of 9 rounds. Run: mpiexec -n 2
python results/paired/native_overhead.py"""
import sys, time, numpy as np
import bitcoll
from mpi4py import MPI
comm = bitcoll.init(backend="mpi")
t = comm.transport
c = MPI.COMM_WORLD
for nb in (262144, 1<<20):
    x = np.zeros(nb//4, np.float32); y = np.zeros_like(x)
    it = max(200, (512<<20)//nb)
    def itest():
        q = c.Iallreduce(x, y, op=MPI.SUM)
        while not q.Test(): pass
    ops = {"bitcoll": lambda: comm.allreduce(x, out=y),
           "transport": lambda: t.native_allreduce(x, y, "sum", time.monotonic() + 100),
           "Iallreduce": itest,
           "mpi4py": lambda: c.Allreduce(x, y, op=MPI.SUM)}
    res = {k: [] for k in ops}
    for r in range(9):
        for k, f in ops.items():
            c.Barrier(); t0 = time.perf_counter()
            for _ in range(it):
                f()
            res[k].append((time.perf_counter() - t0) / it * 1e6)
    if c.rank == 0:
        print(nb, {k: round(min(v), 2) for k, v in res.items()})
comm.close()
