"""Where the machine's time goes in a large all-reduce on the testbed, bitcoll against gloo in one
job, their loops alternating round by round (as osu_paired's), each round a fixed number of
in-place float32 all-reduces. Rank 0 prints per round: ms per call; the whole machine's CPU
per call from /proc/stat in jiffies (1 jiffy = 10 ms; busy = everything but idle and iowait,
then idle, softirq, system, user); host 0's eth0 packets per call and bytes per packet (sent);
host 0's TCP counters per call (segments retransmitted, SACK reordering events, DSACKed
segments, i.e. retransmissions the receiver already had); and the machine's softirqs per call
by kind (NET_TX and HRTIMER count, among others, the shaper's deferred transmissions: tbf holds
a packet that finds its bucket empty and sends it from a timer).
Run: python bench/netbed.py --hosts 4 --rate 10gbit results/paired/cpu_accounting.py
[SIZES (bytes, comma-separated) [ROUNDS [CALLS]]], with BITCOLL_SEND_BUFFER set or not;
output in cpu_accounting.txt."""
import sys, time, numpy as np  # noqa: E401
sys.path.insert(0, "bench")
import osu, osu_allreduce  # noqa: E401

sizes = [int(s) for s in (sys.argv[1] if len(sys.argv) > 1 else "67108864,268435456").split(",")]
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 6
calls = int(sys.argv[3]) if len(sys.argv) > 3 else 10
sides = {"bitcoll": osu.BitcollRuntime(), "gloo": osu.open_runtime("gloo")}


def machine() -> list[int]:  # user nice system idle iowait irq softirq steal ...
    return [int(v) for v in open("/proc/stat").readline().split()[1:]]


def softirqs() -> dict[str, int]:
    d = {}
    for line in open("/proc/softirqs").read().split("\n")[1:]:
        if line.strip():
            parts = line.split()
            d[parts[0].rstrip(":")] = sum(int(v) for v in parts[1:])
    return d


def link() -> list[int]:
    base = "/sys/class/net/eth0/statistics/"
    return [int(open(base + k).read()) for k in ("tx_packets", "tx_bytes")]


def tcp() -> dict[str, int]:
    d = {}
    for name in ("/proc/net/snmp", "/proc/net/netstat"):
        lines = [line for line in open(name).read().split("\n") if line]
        for head, vals in zip(lines[::2], lines[1::2]):
            for k, v in zip(head.split()[1:], vals.split()[1:]):
                d[head.split()[0] + k] = int(v)
    return d


KEYS = ("Tcp:RetransSegs", "TcpExt:TCPSACKReorder", "TcpExt:TCPDSACKRecvSegs")
rank = sides["bitcoll"].rank
for size in sizes:
    x = np.zeros(size // 4, np.float32)
    ops = {name: osu_allreduce.make_op(side, x, x, True, "auto")[0] for name, side in sides.items()}
    for op in ops.values():
        op(); op()  # noqa: E702
    for r in range(rounds):
        for name in (("bitcoll", "gloo") if r % 2 == 0 else ("gloo", "bitcoll")):
            sides["bitcoll"].barrier()
            q0 = softirqs(); c0, l0, t0, s0 = machine(), link(), tcp(), time.perf_counter()
            for _ in range(calls):
                ops[name]()
            sides["bitcoll"].barrier()
            dt = (time.perf_counter() - s0) / calls
            c = [b - a for a, b in zip(c0, machine())]
            l1 = [b - a for a, b in zip(l0, link())]
            t1 = tcp(); q1 = softirqs()
            if rank == 0:
                busy = sum(c) - c[3] - c[4]
                print(f"{name:8s} {size:>10d} round {r}: {dt * 1e3:7.1f} ms/call | CPU per call "
                      f"busy {busy / calls:5.1f} idle {c[3] / calls:4.1f} softirq {c[6] / calls:4.1f}"
                      f" sys {c[2] / calls:4.1f} user {c[0] / calls:4.1f} | tx {l1[0] / calls:5.0f} "
                      f"pkts of {l1[1] / max(1, l1[0]):5.0f} B | "
                      + " ".join(f"{k.split(':')[1]} {(t1[k] - t0[k]) / calls:4.1f}" for k in KEYS),
                      flush=True)
                print("   softirqs/call", " ".join(f"{k} {(q1[k]-q0[k])/calls:.0f}" for k in ("NET_TX", "NET_RX", "TASKLET", "HRTIMER")), flush=True)
for side in sides.values():
    side.close()
