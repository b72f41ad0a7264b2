"""Packets and TCP segments per call of a 64 MiB in-place all-reduce, bitcoll and gloo in one
job on the testbed (each rank reads its own host's /proc/net counters, so run one rank per
host), 4 alternating rounds of 8 calls, medians.
Run: python bench/netbed.py --hosts 4 --rate 10gbit results/paired/packets.py"""
import sys, time, numpy as np
sys.path.insert(0, "bench")
import osu, osu_allreduce
rt = osu.BitcollRuntime()
ref = osu.open_runtime("gloo")
nb = int(sys.argv[1]) if len(sys.argv) > 1 else 64 << 20


def counters() -> np.ndarray:
    rx = tx = 0
    for line in open("/proc/net/dev").read().splitlines()[2:]:
        name, rest = line.split(":", 1)
        if name.strip() == "lo":
            continue
        f = rest.split()
        rx += int(f[1]); tx += int(f[9])
    snmp = open("/proc/net/snmp").read().splitlines()
    tcp = [l.split() for l in snmp if l.startswith("Tcp:")]
    t = dict(zip(tcp[0][1:], tcp[1][1:]))
    ext = open("/proc/net/netstat").read().splitlines()
    te = [l.split() for l in ext if l.startswith("TcpExt:")]
    e = dict(zip(te[0][1:], te[1][1:]))
    return np.array([rx, tx, int(t["InSegs"]), int(t["OutSegs"]), int(e.get("DelayedACKs", 0)),
                     int(e.get("TCPPureAcks", 0)), int(e.get("TCPHPAcks", 0))], float)


rows = {}
for side in (rt, ref):
    x = np.zeros(nb // 4, np.float32)
    op, _ = osu_allreduce.make_op(side, x, x, True, "auto")
    rows[side.impl] = (side, op)
res = {k: [] for k in rows}
for r in range(4):
    for k, (side, op) in (list(rows.items()) if r % 2 == 0 else list(rows.items())[::-1]):
        op(); side.barrier()
        c0 = counters(); w = time.perf_counter()
        it = 8
        for _ in range(it):
            op()
        w = time.perf_counter() - w
        side.barrier()
        res[k].append(np.concatenate([[w / it * 1e3], (counters() - c0) / it]))
for k, v in res.items():
    print(f"rank {rt.rank} {k}: wall ms, rx pkts, tx pkts, InSegs, OutSegs, DelayedACKs, "
          "PureAcks, HPAcks per call (median):", np.round(np.median(np.array(v), axis=0), 0),
          flush=True)
ref.close(); rt.close()
