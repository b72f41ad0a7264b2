import os, resource, sys, time
import numpy as np
impl = sys.argv[1]; n = int(sys.argv[2]) // 4; iters = int(sys.argv[3])
x = np.ones(n, np.float32)
if impl == "gloo":
    import torch, torch.distributed as dist
    os.environ["MASTER_PORT"] = str(int(os.environ["MASTER_PORT"]) + 7)
    dist.init_process_group("gloo")
    t = torch.from_numpy(x)
    op = lambda: dist.all_reduce(t)
    bar = dist.barrier
else:
    import bitcoll
    comm = bitcoll.init(segment_bytes=int(sys.argv[4])) if len(sys.argv) > 4 else bitcoll.init()
    op = lambda: comm.allreduce(x, out=x)
    bar = comm.barrier
op(); bar()
r0 = resource.getrusage(resource.RUSAGE_SELF); t0 = time.perf_counter()
for _ in range(iters): op()
bar()
dt = (time.perf_counter() - t0) / iters
r1 = resource.getrusage(resource.RUSAGE_SELF)
print(f"{impl} rank {os.environ['RANK']}: {dt*1e3:.1f} ms/call user {(r1.ru_utime-r0.ru_utime)/iters*1e3:.1f} sys {(r1.ru_stime-r0.ru_stime)/iters*1e3:.1f} ms/call vcsw {(r1.ru_nvcsw-r0.ru_nvcsw)/iters:.0f} ivcsw {(r1.ru_nivcsw-r0.ru_nivcsw)/iters:.0f}", flush=True)
