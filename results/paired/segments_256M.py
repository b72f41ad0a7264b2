"""bitcoll's in-place all-reduce with several dense segment sizes, and gloo's, in one job, the
cases alternating round by round (3 calls each, then a barrier); best and median wall time per
call over the rounds, rank 0.
Run: python bench/netbed.py --hosts 4 --rate 10gbit results/paired/segments_256M.py BYTES
SEGMENT_BYTES[,SEGMENT_BYTES...] [ROUNDS]"""
import os, sys, time, numpy as np
sys.path.insert(0, "bench")
import osu, osu_allreduce
rt = osu.BitcollRuntime()
ref = osu.open_runtime("gloo")
nb = int(sys.argv[1]); segs = [int(s) for s in sys.argv[2].split(",")]
n = nb // 4
x = np.zeros(n, np.float32); y = np.zeros(n, np.float32)
bop, _ = osu_allreduce.make_op(rt, x, y, True, "auto")
gop, _ = osu_allreduce.make_op(ref, x, y, True, "auto")
cases = [(f"bitcoll seg {s >> 20}M", rt, bop, s) for s in segs] + [("gloo", ref, gop, None)]
res = {c[0]: [] for c in cases}
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 5
for r in range(rounds):
    for name, side, op, seg in (cases if r % 2 == 0 else cases[::-1]):
        if seg is not None:
            rt.comm.segment_bytes = seg
        op(); side.barrier()
        it = 3
        t0 = time.perf_counter()
        for _ in range(it):
            op()
        side.barrier()
        res[name].append((time.perf_counter() - t0) / it * 1e3)
if rt.rank == 0:
    for k, v in res.items():
        print(f"{k:16s} best {min(v):8.1f} ms  median {np.median(v):8.1f} ms", flush=True)
ref.close()
rt.close()
