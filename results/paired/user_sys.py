"""User and system CPU time (os.times) and context switches (getrusage) per call of a 64 MiB
in-place all-reduce, bitcoll and gloo in one job, 4 alternating rounds of 8 calls, medians.
Run: python bench/netbed.py --hosts 4 --rate 10gbit results/paired/user_sys.py"""
import os, sys, time, resource, numpy as np
sys.path.insert(0, "bench")
import osu, osu_allreduce
rt = osu.BitcollRuntime()
ref = osu.open_runtime("gloo")
nb = int(sys.argv[1]) if len(sys.argv) > 1 else 64 << 20
n = nb // 4
rows = {}
for side in (rt, ref):
    x = np.zeros(n, np.float32); y = np.zeros(n, np.float32)
    op, _ = osu_allreduce.make_op(side, x, y, True, "auto")
    rows[side.impl] = (side, op)
res = {k: [] for k in rows}
for r in range(4):
    for k, (side, op) in (list(rows.items()) if r % 2 == 0 else list(rows.items())[::-1]):
        op(); side.barrier()
        t0 = os.times(); u0 = resource.getrusage(resource.RUSAGE_SELF); w = time.perf_counter()
        it = 8
        for _ in range(it):
            op()
        w = time.perf_counter() - w
        t1 = os.times(); u1 = resource.getrusage(resource.RUSAGE_SELF)
        res[k].append((w / it * 1e3, (t1.user - t0.user) / it * 1e3, (t1.system - t0.system) / it * 1e3,
                       (u1.ru_nvcsw - u0.ru_nvcsw) / it, (u1.ru_nivcsw - u0.ru_nivcsw) / it))
for k, v in res.items():
    a = np.array(v)
    print(f"rank {rt.rank} {k}: wall/user/sys ms, vol/invol csw per call (median):", np.round(np.median(a, axis=0), 1), flush=True)
ref.close(); rt.close()
