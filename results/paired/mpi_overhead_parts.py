"""The parts of bitcoll's 1 MiB all-reduce over MPI, each against mpi4py's blocking Allreduce in
the same job, loops alternating round by round: bitcoll (argument check + MPI's all-reduce), the
transport's record exchange + native_allreduce, native_allreduce alone, MPICH's Iallreduce polled
with a tight Test loop, and the record exchange before mpi4py's Allreduce. Prints the best time and
the median / min / max of the per-round ratios. Run: mpiexec -n 2 python
results/paired/mpi_overhead_parts.py ROUNDS [BYTES]"""
import sys, time, numpy as np
import bitcoll
from mpi4py import MPI
comm = bitcoll.init(backend="mpi")
t = comm.transport
c = MPI.COMM_WORLD
nb = int(sys.argv[2]) if len(sys.argv) > 2 else 1 << 20
x = np.ones(nb//4, np.float32); y = np.ones_like(x)
it = 200
seq = [0]
def exch():
    seq[0] += 1
    t.exchange_records(seq[0], 5, None, time.monotonic() + 100)
def itest():
    q = c.Iallreduce(x, y, op=MPI.SUM)
    while not q.Test(): pass
ops = {"mpi4py": lambda: c.Allreduce(x, y, op=MPI.SUM),
       "bitcoll": lambda: comm.allreduce(x, out=y),
       "exch+native": lambda: (exch(), t.native_allreduce(x, y, "sum", time.monotonic() + 100)),
       "native": lambda: t.native_allreduce(x, y, "sum", time.monotonic() + 100),
       "Iallreduce": itest,
       "exch+mpi4py": lambda: (exch(), c.Allreduce(x, y, op=MPI.SUM)),
       }
res = {k: [] for k in ops}
for r in range(int(sys.argv[1])):
    for k, f in ops.items():
        c.Barrier(); t0 = time.perf_counter()
        for _ in range(it):
            f()
        res[k].append((time.perf_counter() - t0) / it * 1e6)
if c.rank == 0:
    base = np.array(res["mpi4py"])
    for k, v in res.items():
        v = np.array(v)
        print(f"{k:12s} best {v.min():8.2f} median ratio {np.median(v/base):.3f}  min {np.min(v/base):.3f} max {np.max(v/base):.3f}")
comm.close()
