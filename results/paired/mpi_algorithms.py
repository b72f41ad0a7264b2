"""MPICH's Allreduce, bitcoll forced to MPI's own all-reduce (behind the argument check), and
bitcoll's default, loops alternating round by round in one job; latency is the slowest rank's
per round; prints the best round and the median of the per-round ratios to Allreduce.
Run: mpiexec -n N python results/paired/mpi_algorithms.py BYTES [ROUNDS]"""
import sys, time, numpy as np
import bitcoll
from mpi4py import MPI
comm = bitcoll.init(backend="mpi")
c = MPI.COMM_WORLD
nb = int(sys.argv[1])
x = np.random.rand(nb // 4).astype(np.float32); y = np.zeros_like(x)
it = min(300, max(20, int(5e7 // nb)))
ops = {"Allreduce": lambda: c.Allreduce([x, MPI.FLOAT], [y, MPI.FLOAT], MPI.SUM),
       "native": lambda: comm.allreduce(x, out=y, algorithm="native"),
       "default": lambda: comm.allreduce(x, out=y)}
res = {k: [] for k in ops}
for _ in range(int(sys.argv[2]) if len(sys.argv) > 2 else 9):
    for k, f in ops.items():
        c.Barrier(); t0 = time.perf_counter()
        for _ in range(it):
            f()
        res[k].append(c.allreduce((time.perf_counter() - t0) / it * 1e6, op=MPI.MAX))
if c.rank == 0:
    base = np.array(res["Allreduce"])
    print(f"{nb} bytes, {c.size} ranks: " + "   ".join(
        f"{k} {min(v):.1f} us ({np.median(np.array(v) / base):.3f})" for k, v in res.items()))
comm.close()
