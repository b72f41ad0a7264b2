"""Whole-machine kernel profile of a 64 MiB in-place all-reduce loop on the testbed, one
implementation per job (IMPL=bitcoll|gloo; SEG=bytes sets bitcoll's segment size; TAG names the
output perf_TAG.data in the working directory). Rank 0 runs `perf record -a -g -F 999` for 5 s of a 7 s loop.
Run: IMPL=bitcoll SEG=1048576 TAG=seg1048576 python bench/netbed.py --hosts 4 --rate 10gbit
results/paired/kernel_profile.py; the table in kernel_profile.txt is `perf report --sort sym
-n` per call; the stacks below it `python3 results/paired/kernel_profile_stacks.py
perf_TAG.data _raw_spin_unlock_irqrestore 5 14` (the first table's runs were recorded
without -g)."""
import os, sys, time, subprocess, numpy as np  # noqa: E401
sys.path.insert(0, "bench")
import osu, osu_allreduce
impl = os.environ["IMPL"]
tag = os.environ.get("TAG", impl)
side = osu.BitcollRuntime() if impl == "bitcoll" else osu.open_runtime("gloo")
if impl == "bitcoll" and os.environ.get("SEG"):
    side.comm.segment_bytes = int(os.environ["SEG"])
x = np.zeros((64 << 20) // 4, np.float32)
op, _ = osu_allreduce.make_op(side, x, x, True, "auto")
for _ in range(3):
    op()
side.barrier()
p = None
if side.rank == 0:
    p = subprocess.Popen(["perf", "record", "-a", "-g", "-F", "999", "-o", f"perf_{tag}.data", "--", "sleep", "5"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
t0 = time.perf_counter(); n = 0
while time.perf_counter() - t0 < 7:
    op(); n += 1
side.barrier()
if p: p.wait()
print(tag, "calls", n, "per call ms", (time.perf_counter() - t0) / n * 1e3, flush=True)
side.close()
