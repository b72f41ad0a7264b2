"""System calls of rank 0 (all its threads, `strace -c`) during 8 calls of a 64 MiB in-place
all-reduce, bitcoll then gloo in one job on the testbed; writes strace_bitcoll.txt and
strace_gloo.txt in the working directory.
Run: python bench/netbed.py --hosts 4 --rate 10gbit results/paired/syscalls.py"""
import os, sys, time, subprocess, signal, numpy as np
sys.path.insert(0, "bench")
import osu, osu_allreduce
rt = osu.BitcollRuntime()
ref = osu.open_runtime("gloo")
nb = 64 << 20
rows = {}
for side in (rt, ref):
    x = np.zeros(nb // 4, np.float32)
    op, _ = osu_allreduce.make_op(side, x, x, True, "auto")
    rows[side.impl] = (side, op)
for k, (side, op) in rows.items():
    op(); op(); side.barrier()
    p = None
    if rt.rank == int(os.environ.get("TRACE_RANK", "0")):
        tids = os.listdir(f"/proc/{os.getpid()}/task")
        args = ["strace", "-c", "-o", f"strace_{k}.txt"]
        for t in tids:
            args += ["-p", t]
        p = subprocess.Popen(args, stderr=subprocess.DEVNULL)
        time.sleep(1.0)
    side.barrier()
    for _ in range(8):
        op()
    side.barrier()
    if p is not None:
        p.send_signal(signal.SIGINT); p.wait()
ref.close(); rt.close()
