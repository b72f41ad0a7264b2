"""Where the machine's time goes in a large all-reduce on the testbed, bitcoll against gloo in one
job, their loops alternating round by round (as osu_paired's), each round a fixed number of
in-place float32 all-reduces. Rank 0 prints per round: ms per call; the whole machine's CPU
per call from /proc/stat in jiffies (1 jiffy = 10 ms; busy = everything but idle and iowait,
then idle, softirq, system, user); host 0's eth0 packets per call and bytes per packet (sent);
host 0's TCP counters per call (segments retransmitted, SACK reordering events, DSACKed
segments, i.e. retransmissions the receiver already had); and the machine's softirqs per call
by kind (NET_TX and HRTIMER count, among others, the shaper's deferred transmissions: tbf holds
a packet that finds its bucket empty and sends it from a timer).
Run: ``python bench/netbed.py --hosts 4 --rate 10gbit bench/experiments/cpu_accounting.py
[SIZES (bytes, comma-separated) [ROUNDS [CALLS]]]``, with BITCOLL_SEND_BUFFER set or not.
Ran at commit ede7df2 as ``results/paired/cpu_accounting.py`` (output:
``results/paired/cpu_accounting*.txt``).
"""

from __future__ import annotations

import sys
import time

import numpy as np
import osu
import osu_allreduce

sizes = [int(s) for s in (sys.argv[1] if len(sys.argv) > 1 else "67108864,268435456").split(",")]
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 6
calls = int(sys.argv[3]) if len(sys.argv) > 3 else 10
sides = {"bitcoll": osu.BitcollRuntime(), "gloo": osu.open_runtime("gloo")}


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def machine() -> list[int]:  # user nice system idle iowait irq softirq steal ...
    return [int(v) for v in _read("/proc/stat").split("\n", 1)[0].split()[1:]]


def softirqs() -> dict[str, int]:
    d = {}
    for line in _read("/proc/softirqs").split("\n")[1:]:
        if line.strip():
            parts = line.split()
            d[parts[0].rstrip(":")] = sum(int(v) for v in parts[1:])
    return d


def link() -> list[int]:
    base = "/sys/class/net/eth0/statistics/"
    return [int(_read(base + k)) for k in ("tx_packets", "tx_bytes")]


def tcp() -> dict[str, int]:
    d = {}
    for name in ("/proc/net/snmp", "/proc/net/netstat"):
        lines = [line for line in _read(name).split("\n") if line]
        for head, vals in zip(lines[::2], lines[1::2], strict=False):
            for k, v in zip(head.split()[1:], vals.split()[1:], strict=False):
                d[head.split()[0] + k] = int(v)
    return d


KEYS = ("Tcp:RetransSegs", "TcpExt:TCPSACKReorder", "TcpExt:TCPDSACKRecvSegs")
rank = sides["bitcoll"].rank
for size in sizes:
    x = np.zeros(size // 4, np.float32)
    ops = {name: osu_allreduce.make_op(side, x, x, True, "auto")[0]
           for name, side in sides.items()}
    for op in ops.values():
        op()
        op()
    for r in range(rounds):
        for name in (("bitcoll", "gloo") if r % 2 == 0 else ("gloo", "bitcoll")):
            sides["bitcoll"].barrier()
            q0, c0, l0, t0 = softirqs(), machine(), link(), tcp()
            s0 = time.perf_counter()
            for _ in range(calls):
                ops[name]()
            sides["bitcoll"].barrier()
            dt = (time.perf_counter() - s0) / calls
            c = [b - a for a, b in zip(c0, machine(), strict=False)]
            l1 = [b - a for a, b in zip(l0, link(), strict=False)]
            t1, q1 = tcp(), softirqs()
            if rank == 0:
                busy = sum(c) - c[3] - c[4]
                print(f"{name:8s} {size:>10d} round {r}: {dt * 1e3:7.1f} ms/call | CPU per "
                      f"call busy {busy / calls:5.1f} idle {c[3] / calls:4.1f} softirq "
                      f"{c[6] / calls:4.1f} sys {c[2] / calls:4.1f} user {c[0] / calls:4.1f} | "
                      f"tx {l1[0] / calls:5.0f} "
                      f"pkts of {l1[1] / max(1, l1[0]):5.0f} B | "
                      + " ".join(f"{k.split(':')[1]} {(t1[k] - t0[k]) / calls:4.1f}" for k in KEYS),
                      flush=True)
                kinds = ("NET_TX", "NET_RX", "TASKLET", "HRTIMER")
                print("   softirqs/call",
                      " ".join(f"{k} {(q1[k] - q0[k]) / calls:.0f}" for k in kinds), flush=True)
for side in sides.values():
    side.close()
