"""OSU-style float32 sum all-reduce benchmark: bitcoll, mpi4py's Allreduce, torch gloo.

Run the same loop on three implementations, each under its own launcher::

    python -m launch -n 4 bench/osu_allreduce.py                  # bitcoll over TCP
    mpiexec -n 4 python bench/osu_allreduce.py                    # bitcoll over MPI
    mpiexec -n 4 python bench/osu_allreduce.py --impl mpi4py      # MPI's own Allreduce
    python -m launch -n 4 bench/osu_allreduce.py --impl gloo      # torch.distributed, gloo
    python bench/osu_allreduce.py                                 # one rank (local backend)

Each size (bytes of the float32 vector per rank, default 1K:256M; a size that is not a
multiple of 4 is an error, exit status 2) is timed as described in :mod:`osu`: warm-up,
barrier, one timed loop. Rows are in OSU's layout: the size, the latency averaged over ranks
(``-f``: also its minimum and maximum, and the iteration count, in OSU's column order); with
``--metrics`` (always in ``--json``) then ``AlgBW = Size / Avg``, ``BusBW = AlgBW * 2 (p - 1)
/ p`` and ``CPU(us)``, the process CPU time (all threads) per call averaged over ranks. The
timed input is a vector
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
ALGORITHMS = ("auto", "ring", "recursive_doubling", "hierarchical", "native")


def check_input(n: int, rank: int) -> F32:
    """The ``--check`` input of ``rank``: ``(i mod 13) + rank`` as float32."""
    return osu.ramp(n, rank)


def check_expected(n: int, size: int) -> F32:
    """The exact float32 sum of :func:`check_input` over ``size`` ranks."""
    x = osu.ramp(n, 0.0)
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
    osu.add_dense_args(p, ALGORITHMS, "bitcoll all-reduce algorithm (default auto)")
    p.add_argument("--inplace", action="store_true",
                   help="bitcoll/mpi4py: reduce in place (gloo always does)")
    osu.add_common_args(p, "1K:256M")
    return p


def run(args: argparse.Namespace, rt: osu.Runtime) -> None:
    """Measure every size of ``args.sizes`` on ``rt`` and print the table on rank 0."""
    schedule = osu.schedule_from_args(args)
    report = osu.Report(rt.rank, args.json)
    inplace = args.inplace or args.impl == "gloo"
    osu.start_dense_table(
        report, rt, args, "Allreduce",
        f"float32 sum, {'in place' if inplace else 'out of place'}",
        "Size: bytes per rank; latency over ranks; AlgBW = Size / Avg; "
        "BusBW = AlgBW * 2(p-1)/p; GB/s = 1e9 B/s; CPU: process CPU time per call",
        collective="allreduce", inplace=inplace)
    for nbytes in args.sizes:
        n = nbytes // 4
        x: F32 = np.empty(n, dtype=np.float32)
        y: F32 = np.empty(n, dtype=np.float32)
        y.fill(0.0)  # touch every page before timing
        op, result = make_op(rt, x, y, args.inplace, args.algorithm)
        check = (check_input(n, rt.rank), check_expected(n, rt.size)) if args.check else None
        osu.measure_dense(rt, report, schedule, args.full, "allreduce", x, op, result, check)
        del op, result, x, y, check
    report.finish()


def main(argv: list[str] | None = None) -> int:
    return osu.tool_main(parser(), argv, osu.open_dense_runtime, run,
                         validate=osu.check_dense_args)


if __name__ == "__main__":
    sys.exit(main())
