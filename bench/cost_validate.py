"""The cost model against measurements: for every size and every algorithm of a collective,
the measured time (best of interleaved rounds) beside the model's prediction, and whether the
planner's pick is within 5% of the fastest algorithm measured.

::

    python bench/netbed.py --hosts 4 --rate 1gbit bench/cost_validate.py --link 1gbit
    python -m launch -n 2 bench/cost_validate.py --collective allreduce -m 8,64K,1M,16M
    python -m launch -n 4 bench/cost_validate.py --collective allgather -m 8,64K,1M,16M
    python bench/netbed.py --hosts 4 --rate 1gbit bench/cost_validate.py --link 1gbit \
        --host-cores 0.5          # 4 emulated hosts sharing 2 cores

Columns: size (bytes of the float32 input; each rank's, for the all-gather), algorithm,
measured µs (best round, averaged over ranks), predicted µs, predicted / measured, ``*`` on
the planner's pick and ``+`` on the fastest measured. Below each size: ``pick/best`` =
measured time of the pick over the fastest.
``--link`` sets the model's remote bandwidth to the testbed's nominal rate times 0.96 (what
TCP gets through tbf, see the environment notes) so the prediction uses the link the job has;
every rank sets the same model.

The testbed's links are token buckets (``tc ... tbf``, ``NETBED_BURST`` bytes, which
``bench/netbed.py`` gives the job): a link passes as many bytes as it saved up while idle
(up to the bucket) faster than its rate, which no real link does, so a short timed loop
measures the bucket, not the link (4M packed elements on 2 hosts at 1 Gbit: 4.2 ms per call
over a loop of two calls, where the link needs 4.4 ms for the bytes). Over a loop that sends
at least ``--bucket-share`` times the bucket (default 20) the saved-up bytes shorten it by at
most that share (5%): each timed loop runs that many calls more, as far as
``MAX_LOOP_SECONDS`` allows (the count taken from one call's bytes and time, the same on
every rank). A call too small to be limited by the link is unaffected.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from functools import partial

import numpy as np
import osu
from netbed import BURST_ENV

from bitcoll.plan import Call, candidates, choose, predict

ROUNDS = 3
#: The longest a timed loop is made to run so that it outlasts the links' buckets.
MAX_LOOP_SECONDS = 0.25
RATES = {"100mbit": 1.25e7, "1gbit": 1.25e8, "10gbit": 1.25e9}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--collective", choices=("packed", "allreduce", "allgather"),
                   default="packed")
    p.add_argument("-m", "--sizes", type=osu.sizes_arg, default=osu.sizes_arg("4K,256K,16M,256M"),
                   help="sizes in bytes of the float32 input, each rank's (default "
                        "4K,256K,16M,256M)")
    p.add_argument("--link", choices=tuple(RATES), default=None,
                   help="the testbed's link rate, for the model's remote bandwidth")
    p.add_argument("--host-cores", type=float, default=None, metavar="C",
                   help="the cores each host has, for the model (the testbed's hosts share the "
                        "machine's cores: 2 cores and 4 hosts give 0.5)")
    p.add_argument("--bucket-share", type=float, default=20.0, metavar="K",
                   help="make each timed loop send at least K times the links' bucket "
                        "(NETBED_BURST bytes; 0: as many calls as for any link; default 20)")
    args = p.parse_args(argv)
    loop_bytes = int(os.environ.get(BURST_ENV, "0") or 0) * args.bucket_share
    rt = osu.BitcollRuntime(timeout=600.0)
    comm = rt.comm
    if args.link is not None:
        comm.cost_model = comm.cost_model.replace(remote_bandwidth=RATES[args.link] * 0.96)
    if args.host_cores is not None:
        comm.cost_model = comm.cost_model.replace(host_cores=args.host_cores)
    group = comm.plan_group
    if rt.rank == 0:
        print(f"# bitcoll cost model validation: {args.collective}, {group}")
        print(f"# model: {comm.cost_model}")
        if loop_bytes > 0:
            print(f"# each timed loop sends at least {loop_bytes:.0f} bytes (the links' bucket x "
                  f"{args.bucket_share:g}) or runs {MAX_LOOP_SECONDS:g} s")
        print("# Size        algorithm            measured_us  predicted_us  pred/meas  mark")
    for nbytes in args.sizes:
        n = nbytes // 4
        v = np.random.default_rng(rt.rank).standard_normal(n).astype(np.float32)
        if args.collective == "packed":
            call = Call(count=n, segment_bytes=comm.packed_segment_bytes or 0)
        else:  # the all-gather's call is its output, every rank's input
            total = nbytes * (comm.size if args.collective == "allgather" else 1)
            call = Call(nbytes=total, segment_bytes=comm.segment_bytes)
        names = [a.name for a in candidates(args.collective, group, call)]
        pick = choose(args.collective, comm.cost_model, group, call)
        if args.collective == "packed":
            out = np.empty(n, np.int8)
            ops = {a: partial(comm.sign_allreduce, v, out=out, algorithm=a) for a in names}
        elif args.collective == "allgather":
            res = np.empty(n * comm.size, np.float32)
            ops = {a: partial(comm.allgather, v, out=res, algorithm=a) for a in names}
        else:
            res = np.empty(n, np.float32)
            ops = {a: partial(comm.allreduce, v, out=res, algorithm=a) for a in names}
        iters, warm = (2, 1) if nbytes >= 16 << 20 else (20, 2) if nbytes >= 256 << 10 \
            else (200, 20)
        loops = dict.fromkeys(names, iters)
        if loop_bytes > 0:
            for a in names:  # the bytes and time of one call: the same on every rank
                once = osu.time_loop(rt, ops[a], 1, warm)
                calls = math.ceil(loop_bytes / max(1.0, once.wire_bytes or 0.0))
                cap = math.floor(MAX_LOOP_SECONDS / max(1e-6, once.avg_us * 1e-6))
                loops[a] = max(iters, min(calls, cap))
        best = dict.fromkeys(names, float("inf"))
        for r in range(ROUNDS):
            order = names if r % 2 == 0 else names[::-1]
            for a in order:
                best[a] = min(best[a], osu.time_loop(rt, ops[a], loops[a], warm).avg_us)
        fastest = min(best, key=lambda a: best[a])
        if rt.rank == 0:
            for a in names:
                pred = predict(args.collective, a, comm.cost_model, group, call) * 1e6
                mark = ("*" if a == pick else "") + ("+" if a == fastest else "")
                print(f"{nbytes:<12d}  {a:<20s}{best[a]:>12.1f}{pred:>14.1f}"
                      f"{pred / best[a]:>11.2f}  {mark or '-'}")
            print(f"# {nbytes} bytes: pick {pick}, fastest {fastest}, pick/best "
                  f"{best[pick] / best[fastest]:.3f}", flush=True)
    rt.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
