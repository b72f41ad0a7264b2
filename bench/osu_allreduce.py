"""OSU-style float32 sum all-reduce benchmark: bitcoll, mpi4py's Allreduce, torch gloo.

Run the same loop on three implementations, each under its own launcher::

    python -m launch -n 4 bench/osu_allreduce.py                  # bitcoll over TCP
    mpiexec -n 4 python bench/osu_allreduce.py                    # bitcoll over MPI
    mpiexec -n 4 python bench/osu_allreduce.py --impl mpi4py      # MPI's own Allreduce
    python -m launch -n 4 bench/osu_allreduce.py --impl gloo      # torch.distributed, gloo
    python bench/osu_allreduce.py                                 # one rank (local backend)

Each size (bytes of the float32 vector per rank, default 1K:256M; a size that is not a
multiple of 4 is an error, exit status 2) is timed as described in :mod:`osu`: warm-up,
barrier, one timed loop; latency averaged over ranks (``-f``: also its minimum and maximum,
and the iteration count, in OSU's column order); ``AlgBW = Size / Avg``, ``BusBW = AlgBW * 2
(p - 1) / p``; ``CPU(us)`` is the process CPU time (all threads) per call averaged over
ranks. The timed input is a vector
of zeros (the fixed point of an in-place sum, so gloo's in-place all-reduce cannot overflow);
``--check`` runs one extra call per size on the input ``(i mod 13) + rank`` and compares the
result with the exact sum. bitcoll and mpi4py reduce out of place unless ``--inplace``; gloo
always reduces in place. gloo is set up from the launcher's environment (``MASTER_PORT`` plus
``--gloo-port-offset``). ``--algorithm`` forces a bitcoll algorithm (auto, ring,
recursive_doubling, native).

Exit status 0, or 1 after an error or a failed check (the other ranks are released).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import numpy as np
import numpy.typing as npt
import osu

F32 = npt.NDArray[np.float32]
ALGORITHMS = ("auto", "ring", "recursive_doubling", "native")


def columns(full: bool) -> list[osu.Column]:
    """The table's columns (``full``: OSU's -f statistics after the average)."""
    return [osu.Column("Size", 10, "d"), *osu.latency_columns(full),
            osu.Column("AlgBW(GB/s)", 14, ".3f"), osu.Column("BusBW(GB/s)", 14, ".3f"),
            osu.Column("CPU(us)", 14, ".0f")]


def check_input(n: int, rank: int) -> F32:
    """The ``--check`` input of ``rank``: ``(i mod 13) + rank`` as float32."""
    x = (np.arange(n, dtype=np.int32) % 13).astype(np.float32)
    x += np.float32(rank)
    return x


def check_expected(n: int, size: int) -> F32:
    """The exact float32 sum of :func:`check_input` over ``size`` ranks."""
    x = (np.arange(n, dtype=np.int32) % 13).astype(np.float32)
    x *= np.float32(size)
    x += np.float32(size * (size - 1) // 2)
    return x


def make_op(rt: osu.Runtime, x: F32, y: F32, inplace: bool, algorithm: str
            ) -> tuple[Callable[[], object], F32]:
    """Return ``(op, result)``: one all-reduce call of ``x`` and the array it leaves the
    sum in."""
    if isinstance(rt, osu.BitcollRuntime):
        comm = rt.comm
        algo = None if algorithm == "auto" else algorithm
        out = x if inplace else y
        return (lambda: comm.allreduce(x, out=out, algorithm=algo)), out
    if isinstance(rt, osu.MPIRuntime):
        mpi, mcomm = rt.MPI, rt.comm
        if inplace:
            return (lambda: mcomm.Allreduce(mpi.IN_PLACE, x, op=mpi.SUM)), x
        return (lambda: mcomm.Allreduce(x, y, op=mpi.SUM)), y
    if isinstance(rt, osu.GlooRuntime):
        tensor = rt.torch.from_numpy(x)
        dist = rt.dist
        return (lambda: dist.all_reduce(tensor)), x
    raise TypeError(f"unsupported runtime {type(rt).__name__}")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="OSU-style float32 sum all-reduce latency and bandwidth of bitcoll, "
                    "mpi4py or torch gloo.")
    p.add_argument("--impl", choices=osu.IMPLS, default="bitcoll",
                   help="implementation to measure (default bitcoll)")
    p.add_argument("--algorithm", choices=ALGORITHMS, default="auto",
                   help="bitcoll all-reduce algorithm (default auto)")
    p.add_argument("--backend", choices=("auto", "tcp", "mpi", "local"), default="auto",
                   help="bitcoll backend (default: from the environment)")
    p.add_argument("--inplace", action="store_true",
                   help="bitcoll/mpi4py: reduce in place (gloo always does)")
    p.add_argument("--gloo-port-offset", type=int, default=0,
                   help="gloo listens on MASTER_PORT + this (default 0)")
    osu.add_common_args(p, "1K:256M")
    return p


def run(args: argparse.Namespace, rt: osu.Runtime) -> None:
    """Measure every size of ``args.sizes`` on ``rt`` and print the table on rank 0."""
    schedule = osu.schedule_from_args(args)
    p = rt.size
    report = osu.Report(rt.rank, args.json)
    algo = args.algorithm if args.impl == "bitcoll" else "-"
    placement = "in place" if args.inplace or args.impl == "gloo" else "out of place"
    info = rt.describe()
    report.start(f"bitcoll OSU-style Allreduce Test, backend {rt.backend}, {osu.ranks(p)}",
                 [f"impl {args.impl}, algorithm {algo}, float32 sum, {placement}"
                  + (f", {info}" if info else ""),
                  "Size: bytes per rank; latency over ranks; AlgBW = Size / Avg; "
                  "BusBW = AlgBW * 2(p-1)/p; GB/s = 1e9 B/s; CPU: process CPU time per call"],
                 columns(args.full), impl=args.impl, backend=rt.backend, ranks=p, algorithm=algo,
                 collective="allreduce", inplace=placement == "in place")
    for nbytes in args.sizes:
        n = nbytes // 4
        x: F32 = np.empty(n, dtype=np.float32)
        y: F32 = np.empty(n, dtype=np.float32)
        y.fill(0.0)  # touch every page before timing
        op, result = make_op(rt, x, y, args.inplace, args.algorithm)
        if args.check:
            np.copyto(x, check_input(n, rt.rank))
            op()
            ok = bool(np.array_equal(result, check_expected(n, p)))
            osu.agree(rt, ok, f"allreduce of {nbytes} bytes")
        x.fill(0.0)
        iters, warm = schedule.for_bytes(nbytes)
        t = osu.time_loop(rt, op, iters, warm)
        alg = osu.gbps(nbytes, t.avg_us * 1e-6)
        report.row(nbytes, *osu.latency_values(t, args.full), alg,
                   alg * osu.bus_factor("allreduce", p), t.cpu_us)
        del op, result, x, y
    report.finish()


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    try:
        osu.schedule_from_args(args)
    except ValueError as exc:
        ap.error(str(exc))
    if args.impl != "bitcoll" and (args.algorithm != "auto" or args.backend != "auto"):
        ap.error("--algorithm and --backend apply to --impl bitcoll only")
    osu.check_whole_elements(ap, args.sizes, 4, "float32")

    def open_rt() -> osu.Runtime:
        return osu.open_runtime(args.impl, backend=args.backend, timeout=args.timeout,
                                port_offset=args.gloo_port_offset)

    def body(rt: osu.Runtime) -> None:
        run(args, rt)

    return osu.run_tool(open_rt, body)


if __name__ == "__main__":
    sys.exit(main())
