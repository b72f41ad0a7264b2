"""What the TCP transport's frame checksum costs: the same collectives with it on and off,
side by side in one job.

Usage (one rank per host; the checksum only exists on TCP links, so shared memory is off)::

    python bench/netbed.py --hosts 2 --rate 10gbit bench/checksum_cost.py -m 1M,4M,16M,64M
    python -m launch -n 2 bench/checksum_cost.py -m 1M:64M          # loopback

The job builds a communicator with the checksum on (``BITCOLL_CHECKSUM=1``), times every
size, closes it and builds one with the checksum off, and again, ``--rounds`` times,
alternating which setting goes first, so that both settings see the same machine. Each timed
point is a warm-up of ``--warmup`` calls, a barrier, then ``iterations`` calls (as many as
``--iter-bytes`` of input allow, at least ``--min-iterations``); its time is the slowest rank's
average per call. Collectives (``--collectives``): ``allreduce`` (float32 sum, out of place,
the streamed ring for large sizes), ``sign`` (``sign_allreduce`` of float32 votes, majority,
packed bits on the wire). Sizes are bytes of float32 input per rank.

Rank 0 prints, per collective and size, the best time of each setting over the rounds (the
least disturbed), every round's times, and the cost ``on / off - 1`` in percent. Exit status
0, 1 after an error.
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
    p.add_argument("--rounds", type=int, default=2, help="on/off alternations")
    p.add_argument("-x", "--warmup", type=int, default=3)
    p.add_argument("--iter-bytes", type=osu.parse_size, default=1 << 30,
                   help="input bytes per timed point (sets the iteration count)")
    p.add_argument("--min-iterations", type=int, default=5)
    p.add_argument("--timeout", type=float, default=300.0)
    return p


def _op(comm: Any, collective: str, x: np.ndarray, y: np.ndarray) -> Any:
    if collective == "allreduce":
        return lambda: comm.allreduce(x, out=y)
    return lambda: comm.sign_allreduce(x)


def _measure(checksum: bool, args: argparse.Namespace,
             collectives: list[str]) -> dict[tuple[str, int], float]:
    """One communicator with ``checksum``; the slowest rank's seconds per call of every
    (collective, size)."""
    import bitcoll

    os.environ["BITCOLL_CHECKSUM"] = "1" if checksum else "0"
    comm = bitcoll.init("tcp", timeout=args.timeout, shm=False)
    out: dict[tuple[str, int], float] = {}
    try:
        transport = getattr(comm.transport, "tcp", comm.transport)
        assert getattr(transport, "checksum", checksum) == checksum, "setting not taken"
        rng = np.random.default_rng(comm.rank)
        for collective in collectives:
            for nbytes in args.sizes:
                n = nbytes // 4
                x = rng.standard_normal(n).astype(np.float32)
                y = np.zeros_like(x)
                op = _op(comm, collective, x, y)
                for _ in range(args.warmup):
                    op()
                iters = max(args.min_iterations, args.iter_bytes // max(nbytes, 1))
                comm.barrier()
                start = time.perf_counter()
                for _ in range(iters):
                    op()
                took = (time.perf_counter() - start) / iters
                out[(collective, nbytes)] = float(comm.allgather(
                    np.array([took], np.float64)).max())
        comm.barrier()
        return out
    finally:
        comm.close()


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    collectives = [c for c in args.collectives.split(",") if c]
    bad = [c for c in collectives if c not in COLLECTIVES]
    if bad or any(s % 4 for s in args.sizes):
        print(f"checksum_cost: bad collectives {bad} or a size not a multiple of 4",
              file=sys.stderr)
        return 2
    runs: dict[bool, list[dict[tuple[str, int], float]]] = {True: [], False: []}
    rank = int(os.environ.get("RANK", "0"))
    for r in range(args.rounds):
        for setting in ((True, False) if r % 2 == 0 else (False, True)):
            runs[setting].append(_measure(setting, args, collectives))
    if rank != 0:
        return 0
    size = int(os.environ.get("WORLD_SIZE", "1"))
    print(f"# checksum_cost: {size} ranks, TCP (shared memory off), {args.rounds} rounds "
          "alternating on/off; time = slowest rank's mean per call; best of the rounds")
    print(f"# {'collective':<10} {'size':>8} {'on (ms)':>10} {'off (ms)':>10} {'cost %':>8}"
          "   rounds on / off (ms)")
    for collective in collectives:
        for nbytes in args.sizes:
            key = (collective, nbytes)
            on = [run[key] for run in runs[True]]
            off = [run[key] for run in runs[False]]
            cost = (min(on) / min(off) - 1) * 100
            detail = " ".join(f"{v * 1e3:.2f}" for v in on) + " / " + \
                " ".join(f"{v * 1e3:.2f}" for v in off)
            print(f"  {collective:<10} {osu.fmt_bytes(nbytes):>8} {min(on) * 1e3:>10.3f} "
                  f"{min(off) * 1e3:>10.3f} {cost:>+8.2f}   {detail}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
