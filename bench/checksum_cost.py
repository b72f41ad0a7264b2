"""What the TCP transport's frame checksum costs: the same collectives with it on and off,
side by side in one job.

Usage (one rank per host; the checksum only exists on TCP links, so shared memory is off)::

    python bench/netbed.py --hosts 2 --rate 10gbit bench/checksum_cost.py -m 1M,4M,16M,64M
    python -m launch -n 2 bench/checksum_cost.py -m 1M:64M          # loopback

The job builds two communicators side by side, one with the checksum on
(``BITCOLL_CHECKSUM=1``, its store on ``BITCOLL_MASTER_PORT``) and one with it off (store on
the next port), and for every collective and size times ``--rounds`` pairs of loops, one on
each, alternating which goes first, so that both settings see the same machine moments apart
(this machine's load drifts by tens of percent within seconds). A loop is a barrier, then as
many calls as ``--iter-bytes`` of input allow (at least ``--min-iterations``), after
``--warmup`` untimed calls per size; its time is the slowest rank's mean per call.
Collectives (``--collectives``): ``allreduce`` (float32 sum, out of place, the streamed ring
for large sizes), ``sign`` (``sign_allreduce`` of float32 votes, majority, packed bits on the
wire). Sizes are bytes of float32 input per rank.

Rank 0 prints, per collective and size, the minimum (the least disturbed loop) and the median
time of each setting over the rounds, and the cost ``on / off - 1`` in percent of each; then
the paired cost: the median over the rounds of each round's ``on / off - 1`` (the two loops
of a round ran moments apart, so a drift of the machine's speed between rounds cancels), with
the quartiles of those per-round costs; and the process CPU time per call (all threads,
mean over ranks; microseconds) of each setting, median over the rounds, with the paired
difference (median over the rounds of on - off): the CPU the checksum costs, steadier than
the latency on a busy machine.
Exit status 0, 2 for bad arguments; an error ends every rank with a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import numpy as np
import osu

COLLECTIVES = ("allreduce", "sign")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Cost of the TCP frame checksum: collectives "
                                            "with it on and off in one job.")
    p.add_argument("-m", "--sizes", type=osu.sizes_arg, default=osu.parse_sizes("1M:64M"),
                   help="bytes of float32 input per rank: a list (1M,4M) or a range "
                        "(1M:64M, powers of two)")
    p.add_argument("--collectives", default="allreduce,sign",
                   help="comma-separated: allreduce, sign")
    p.add_argument("--rounds", type=int, default=9,
                   help="on/off pairs of timed loops per size")
    p.add_argument("-x", "--warmup", type=int, default=3)
    p.add_argument("--iter-bytes", type=osu.parse_size, default=64 << 20,
                   help="input bytes per timed loop (sets its number of calls)")
    p.add_argument("--min-iterations", type=int, default=2)
    p.add_argument("--timeout", type=float, default=300.0)
    return p


def _op(comm: Any, collective: str, x: np.ndarray, y: np.ndarray) -> Any:
    if collective == "allreduce":
        return lambda: comm.allreduce(x, out=y)
    return lambda: comm.sign_allreduce(x)


def _open(checksum: bool, port_shift: int, timeout: float) -> Any:
    """A TCP communicator (no shared memory) with the checksum on or off; its store on the
    launcher's port plus ``port_shift`` (two communicators live side by side)."""
    import bitcoll

    os.environ["BITCOLL_CHECKSUM"] = "1" if checksum else "0"
    base = os.environ.get("BITCOLL_MASTER_PORT") or str(int(os.environ["MASTER_PORT"]) + 1)
    os.environ["BITCOLL_MASTER_PORT"] = str(int(base) + port_shift)
    try:
        comm = bitcoll.init("tcp", timeout=timeout, shm=False)
    finally:
        os.environ["BITCOLL_MASTER_PORT"] = base
    transport = getattr(comm.transport, "tcp", comm.transport)
    assert getattr(transport, "checksum", checksum) == checksum, "setting not taken"
    return comm


def _time(comm: Any, op: Any, iters: int) -> tuple[float, float]:
    """The slowest rank's mean seconds per call of ``iters`` calls after a barrier, and the
    ranks' mean process CPU seconds (all threads) per call."""
    comm.barrier()
    cpu = time.process_time()
    start = time.perf_counter()
    for _ in range(iters):
        op()
    took = (time.perf_counter() - start) / iters
    cpu = (time.process_time() - cpu) / iters
    got = comm.allgather(np.array([took, cpu], np.float64)).reshape(-1, 2)
    return float(got[:, 0].max()), float(got[:, 1].mean())


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    collectives = [c for c in args.collectives.split(",") if c]
    bad = [c for c in collectives if c not in COLLECTIVES]
    if bad or any(s % 4 for s in args.sizes):
        print(f"checksum_cost: bad collectives {bad} or a size not a multiple of 4",
              file=sys.stderr)
        return 2
    comms = {True: _open(True, 0, args.timeout), False: _open(False, 1, args.timeout)}
    rank, size = comms[True].rank, comms[True].size
    rows = []
    try:
        rng = np.random.default_rng(rank)
        for collective in collectives:
            for nbytes in args.sizes:
                n = nbytes // 4
                x = rng.standard_normal(n).astype(np.float32)
                y = np.zeros_like(x)
                ops = {k: _op(c, collective, x, y) for k, c in comms.items()}
                for op in ops.values():
                    for _ in range(args.warmup):
                        op()
                iters = max(args.min_iterations, args.iter_bytes // max(nbytes, 1))
                times: dict[bool, list[float]] = {True: [], False: []}
                cpus: dict[bool, list[float]] = {True: [], False: []}
                for r in range(args.rounds):
                    for setting in ((True, False) if r % 2 == 0 else (False, True)):
                        took, cpu = _time(comms[setting], ops[setting], iters)
                        times[setting].append(took)
                        cpus[setting].append(cpu)
                rows.append((collective, nbytes, iters, times, cpus))
    finally:
        for c in comms.values():
            c.close()
    if rank != 0:
        return 0
    print(f"# checksum_cost: {size} ranks, TCP (shared memory off); per size {args.rounds} "
          "rounds, each timing the checksum on and off (alternating which goes first) over "
          "the same number of calls; time = slowest rank's mean per call (ms)")
    print(f"# {'collective':<10} {'size':>8} {'iters':>5} {'on min':>9} {'off min':>9} "
          f"{'cost%':>7} {'on med':>9} {'off med':>9} {'cost%':>7} {'paired%':>8} "
          f"{'quartiles%':>15} {'cpu on':>8} {'cpu off':>8} {'cpu +us':>8}")
    for collective, nbytes, iters, times, cpus in rows:
        on, off = times[True], times[False]
        lo = (min(on) / min(off) - 1) * 100
        med = (float(np.median(on)) / float(np.median(off)) - 1) * 100
        pairs = (np.asarray(on) / np.asarray(off) - 1) * 100
        q1, q2, q3 = (float(v) for v in np.percentile(pairs, (25, 50, 75)))
        print(f"  {collective:<10} {osu.fmt_bytes(nbytes):>8} {iters:>5} {min(on) * 1e3:>9.3f} "
              f"{min(off) * 1e3:>9.3f} {lo:>+7.2f} {float(np.median(on)) * 1e3:>9.3f} "
              f"{float(np.median(off)) * 1e3:>9.3f} {med:>+7.2f} {q2:>+8.2f} "
              f"{f'{q1:+.1f}..{q3:+.1f}':>15} {float(np.median(cpus[True])) * 1e6:>8.1f} "
              f"{float(np.median(cpus[False])) * 1e6:>8.1f} "
              f"{float(np.median(np.subtract(cpus[True], cpus[False]))) * 1e6:>+8.1f}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
