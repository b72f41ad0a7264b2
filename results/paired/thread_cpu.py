"""Where the CPU of a 64 MiB in-place all-reduce goes, per thread (/proc/self/task utime and
stime, 12 calls after 3 warm-up calls). Run: python bench/netbed.py --hosts 4 --rate 10gbit
results/paired/thread_cpu.py"""
import os, sys, time, numpy as np
import bitcoll
comm = bitcoll.init()
x = np.zeros((64 << 20) // 4, np.float32)
def snap():
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            st = open(f"/proc/self/task/{tid}/stat").read()
            name = open(f"/proc/self/task/{tid}/comm").read().strip()
        except OSError:
            continue
        f = st.rsplit(")", 1)[1].split()
        out[(tid, name)] = (int(f[11]), int(f[12]))  # utime, stime in ticks
    return out
for _ in range(3):
    comm.allreduce(x, out=x)
comm.barrier()
a = snap(); t = time.perf_counter(); n = 12
for _ in range(n):
    comm.allreduce(x, out=x)
w = time.perf_counter() - t
b = snap()
tick = os.sysconf("SC_CLK_TCK")
lines = []
for k in b:
    if k in a:
        du = (b[k][0] - a[k][0]) / tick / n * 1e3; ds = (b[k][1] - a[k][1]) / tick / n * 1e3
        if du + ds > 0.2:
            lines.append(f"{'MAIN' if int(k[0]) == os.getpid() else k[0]:>8} user {du:6.2f} sys {ds:6.2f} ms/call")
print(f"rank {comm.rank} wall {w/n*1e3:.1f} ms/call\n" + "\n".join(lines), flush=True)
comm.close()
