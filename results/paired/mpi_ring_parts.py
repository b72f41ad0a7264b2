"""Where a 1 MiB all-reduce over MPI spends its time, 2 ranks, loops alternating round by round
in one job: MPICH's Allreduce; an exchange of halves written with mpi4py (send the other half,
add, send the reduced half: the ring's data movement for 2 ranks, with no copy of the input);
bitcoll's default all-reduce; its ring forced (the general call path); the ring without the
communicator (the argument check, then allreduce_ring on a fresh context). Prints the best time
and the median of the per-round ratios to Allreduce.
With a third argument "frames", the transport's streams are off (the ring goes frame by frame,
as before streams over MPI).
Run: mpiexec -n 2 python results/paired/mpi_ring_parts.py [BYTES] [ROUNDS] [frames]"""
import sys, time, numpy as np
import bitcoll
from bitcoll.algorithms.allreduce_ring import allreduce_ring
from bitcoll.algorithms.context import OpContext
from bitcoll.ops import ReduceOp
from bitcoll.transport.mpi import MPITransport
from mpi4py import MPI
if sys.argv[3:] == ["frames"]:
    MPITransport.streams = False  # type: ignore[misc]
comm = bitcoll.init(backend="mpi")
t = comm.transport
c = MPI.COMM_WORLD
r = c.rank; o = 1 - r
nb = int(sys.argv[1]) if len(sys.argv) > 1 else 1 << 20
n = nb // 4; h = n // 2
x = np.random.rand(n).astype(np.float32); y = np.zeros_like(x)
tmp = np.empty(h, np.float32)
F = MPI.FLOAT
mine = slice(0, h) if r == 0 else slice(h, n)
other = slice(h, n) if r == 0 else slice(0, h)
def halves():
    rq = c.Irecv([tmp, F], o, 7); sq = c.Isend([x[other], F], o, 7)
    while not rq.Test(): pass
    np.add(x[mine], tmp, out=y[mine])
    rq2 = c.Irecv([y[other], F], o, 8); sq2 = c.Isend([y[mine], F], o, 8)
    while not rq2.Test(): pass
    while not sq.Test(): pass
    while not sq2.Test(): pass
seq = [10**6]
def direct_ring():
    seq[0] += 1
    deadline = time.monotonic() + 100
    t.exchange_records(seq[0], 5, None, deadline)
    allreduce_ring(OpContext(t, seq[0], 5, deadline, 32 << 20, {}), y, ReduceOp.SUM, src=x)
ops = {"Allreduce": lambda: c.Allreduce([x, F], [y, F], MPI.SUM), "halves": halves,
       "default": lambda: comm.allreduce(x, out=y),
       "forced ring": lambda: comm.allreduce(x, out=y, algorithm="ring"),
       "ring, no communicator": direct_ring}
res = {k: [] for k in ops}
for _ in range(int(sys.argv[2]) if len(sys.argv) > 2 else 9):
    for k, f in ops.items():
        c.Barrier(); t0 = time.perf_counter()
        for _ in range(200):
            f()
        res[k].append((time.perf_counter() - t0) / 200 * 1e6)
if r == 0:
    base = np.array(res["Allreduce"])
    print(f"# {nb} bytes, 2 ranks" + (", streams off" if not t.streams else ""))
    for k, v in res.items():
        print(f"{k:22s} best {min(v):8.2f} us  median ratio {np.median(np.array(v) / base):.3f}")
comm.close()
