"""Paired all-reduce comparison: bitcoll against mpi4py's ``Allreduce`` or torch gloo, in one
job, the two timed loops interleaved round by round.

::

    mpiexec -n 2 python bench/osu_paired.py --versus mpi4py -m 8,64K,1M,2M,4M
    python -m launch -n 2 bench/osu_paired.py --versus gloo -m 8,1M,16M
    python bench/netbed.py --hosts 4 --rate 10gbit bench/osu_paired.py --versus gloo -m 16M,64M

Separate runs of ``osu_allreduce.py`` (one per implementation, as ``run_all.py`` does) see
whatever else the machine was doing at the time; on a shared or small machine the spread
between two runs of the same command can exceed the difference being measured. Here both
implementations live in the same processes (bitcoll over MPI beside mpi4py's ``COMM_WORLD``,
or bitcoll over TCP beside a gloo process group), and for every size each of ``--rounds``
rounds times one loop of bitcoll and one of the reference back to back (:func:`osu.time_loop`:
warm-up, barrier, the timed loop), the order alternating between rounds. Load that drifts
over seconds then falls on both sides of a round alike, and the per-round ratio
``bitcoll / reference`` (latency, lower is better for bitcoll) is the paired figure.

Columns: the size in bytes per rank; the best round's latency of each side (µs, averaged over
ranks as in the OSU tools); ``best`` = the ratio of the two best latencies; the median, minimum
and maximum of the per-round ratios; ``faster`` = the share of rounds in which bitcoll's loop
was at least as fast; ``CPU(us)`` and ``refCPU(us)``: the median over the rounds of the
process CPU time per call (all threads, user + system, averaged over ranks) of each side.
Iterations per loop follow the usual schedule (``-i``, ``-x``, ``--iter-bytes``,
``--min-iterations``).

Both sides reduce float32 sums of zeros (a fixed point, so in-place sums cannot overflow).
mpi4py and bitcoll reduce out of place unless ``--inplace``; gloo always reduces in place, so
against gloo bitcoll does too. ``--check`` validates both sides' results once per size.
gloo listens on ``MASTER_PORT + --gloo-port-offset`` (default 0; bitcoll's launcher keeps its
store elsewhere). ``--algorithm`` forces bitcoll's algorithm.

Exit status 0; 1 after an error or a failed check (the other ranks are released); 2 for bad
options.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable

import numpy as np
import osu
import osu_allreduce

VERSUS = ("mpi4py", "gloo")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="bitcoll's float32 all-reduce against mpi4py or gloo in one job, "
                    "the timed loops interleaved round by round.")
    p.add_argument("--versus", choices=VERSUS, required=True,
                   help="the reference: mpi4py (run under mpiexec) or gloo (under the "
                        "launcher or the testbed)")
    p.add_argument("--rounds", type=int, default=7,
                   help="interleaved rounds per size (default 7)")
    p.add_argument("--algorithm", choices=osu_allreduce.ALGORITHMS, default="auto",
                   help="bitcoll all-reduce algorithm (default auto)")
    p.add_argument("--inplace", action="store_true",
                   help="reduce in place on both sides (always so against gloo)")
    p.add_argument("--gloo-port-offset", type=int, default=0,
                   help="gloo listens on MASTER_PORT + this (default 0)")
    osu.add_common_args(p, "8,64K,1M,2M,4M")
    return p


def validate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Reject options that do not fit together (exit status 2)."""
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    osu.check_whole_elements(parser, args.sizes, 4, "float32")


def columns() -> list[osu.Column]:
    return [osu.Column("Size", 12, "d"), osu.Column("bitcoll(us)", 14, ".2f"),
            osu.Column("ref(us)", 12, ".2f"), osu.Column("best", 8, ".3f"),
            osu.Column("median", 8, ".3f"), osu.Column("min", 8, ".3f"),
            osu.Column("max", 8, ".3f"), osu.Column("faster", 8, ".2f"),
            osu.Column("CPU(us)", 12, ".0f"), osu.Column("refCPU(us)", 12, ".0f")]


def run(args: argparse.Namespace, rt: osu.BitcollRuntime) -> None:
    """Time every size of ``args.sizes`` on ``rt`` and on the reference; print on rank 0."""
    ref = osu.open_runtime(args.versus, timeout=args.timeout,
                           port_offset=args.gloo_port_offset)
    try:
        if (ref.rank, ref.size) != (rt.rank, rt.size):
            how = "mpiexec" if args.versus == "mpi4py" else "python -m launch or torchrun"
            raise RuntimeError(f"bitcoll is rank {rt.rank} of {rt.size} but {args.versus} rank "
                               f"{ref.rank} of {ref.size}: run --versus {args.versus} under "
                               f"{how}")
        measure(args, rt, ref)
    finally:
        ref.close()


def measure(args: argparse.Namespace, rt: osu.BitcollRuntime, ref: osu.Runtime) -> None:
    """The table: per size, ``args.rounds`` rounds of one timed loop on ``rt`` and one on
    ``ref`` (the order alternating), then one row of the round statistics (rank 0 prints)."""
    schedule = osu.schedule_from_args(args)
    inplace = args.inplace or args.versus == "gloo"
    report = osu.Report(rt.rank, args.json)
    report.start(
        f"bitcoll OSU-style paired Allreduce Test, backend {rt.backend} against "
        f"{args.versus}, {osu.ranks(rt.size)}",
        [f"algorithm {args.algorithm}, float32 sum, {'in place' if inplace else 'out of place'}"
         f", {args.rounds} interleaved rounds, {rt.describe()}, {ref.describe()}",
         "latency in us averaged over ranks, best round of each side; ratios are bitcoll / "
         f"{args.versus} latency (below 1: bitcoll faster); best = ratio of the best rounds; "
         "median, min, max over the rounds' ratios; faster = share of rounds bitcoll was as "
         "fast or faster; CPU: median per-call process CPU time (all threads)"],
        columns(), versus=args.versus, backend=rt.backend, ranks=rt.size,
        algorithm=args.algorithm, inplace=inplace, rounds=args.rounds)
    for nbytes in args.sizes:
        n = nbytes // 4
        sides: list[tuple[osu.Runtime, Callable[[], object]]] = []
        for side in (rt, ref):
            x = np.empty(n, dtype=np.float32)  # check_once zeroes it
            y = np.empty(n, dtype=np.float32)
            y.fill(0.0)  # touch every page before timing (np.zeros would map them lazily)
            op, result = osu_allreduce.make_op(side, x, y, inplace, args.algorithm)
            check = (osu_allreduce.check_input(n, side.rank),
                     osu_allreduce.check_expected(n, side.size)) if args.check else None
            osu.check_once(side, op, x, result, check, f"{side.impl} all-reduce of {nbytes} bytes")
            sides.append((side, op))
        iters, warm = schedule.for_bytes(nbytes)
        lat: tuple[list[float], list[float]] = ([], [])  # bitcoll's, the reference's
        cpu: tuple[list[float], list[float]] = ([], [])
        for r in range(args.rounds):
            for k in ((0, 1) if r % 2 == 0 else (1, 0)):
                side, op = sides[k]
                t = osu.time_loop(side, op, iters, warm)
                lat[k].append(t.avg_us)
                cpu[k].append(t.cpu_us)
        ours, theirs = lat
        ratios = [a / b for a, b in zip(ours, theirs, strict=True)]
        faster = sum(a <= b for a, b in zip(ours, theirs, strict=True)) / args.rounds
        report.row(nbytes, min(ours), min(theirs), min(ours) / min(theirs),
                   statistics.median(ratios), min(ratios), max(ratios), faster,
                   statistics.median(cpu[0]), statistics.median(cpu[1]))
    report.finish()


def main(argv: list[str] | None = None) -> int:
    return osu.tool_main(parser(), argv, lambda a: osu.BitcollRuntime(timeout=a.timeout), run,
                         validate=validate)


if __name__ == "__main__":
    sys.exit(main())
