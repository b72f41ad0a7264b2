"""OSU-style benchmarks of bitcoll's other dense collectives: reduce_scatter, allgather,
broadcast, alltoall, barrier (float32; sums for reduce_scatter).

Usage (launchers as for ``osu_allreduce.py``)::

    python -m launch -n 4 bench/osu_collectives.py --collective allgather
    python -m launch -n 4 bench/osu_collectives.py --collective all -m 1K:16M
    mpiexec -n 4 python bench/osu_collectives.py --collective alltoall --impl mpi4py
    python -m launch -n 4 bench/osu_collectives.py --collective broadcast --impl gloo

``--collective`` takes one name, a comma list or ``all`` (one table per collective, in the
order given). ``Size`` is the bytes of each rank's *input* buffer: the whole vector for
reduce_scatter (rank ``r`` gets block ``r``), the contribution of one rank for allgather, the
whole buffer for broadcast (root 0) and alltoall. A size must be a whole number of float32
elements (a multiple of 4 bytes; anything else is an error, exit status 2); reduce_scatter and
alltoall then use the largest multiple of the world size of elements that fits (at least one
element per rank; the Size column shows the bytes actually used), so that every
implementation gets equal blocks. ``-f`` adds the minimum and maximum latency over ranks and
the iteration count, in OSU's column order; ``--metrics`` (always in ``--json``) appends
``AlgBW``, ``BusBW`` and ``CPU(us)``. ``AlgBW = S / Avg`` with nccl-tests' ``S`` (the
gathered output for allgather, the input buffer otherwise) and ``BusBW = AlgBW * (p - 1) / p``
(1 for broadcast). barrier prints one row of size 0 without bandwidth. The comparison
implementations use mpi4py's ``Reduce_scatter_block``, ``Allgather``, ``Bcast``,
``Alltoall``, ``Barrier`` and torch's ``reduce_scatter_single``, ``all_gather_single``,
``broadcast``, ``all_to_all_single``, ``barrier`` (older torch: the ``*_tensor`` names).
``--check`` validates one extra call per size against small-integer inputs whose results are
exact.

Exit status 0, or 1 after an error or a failed check.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt
import osu

F32 = npt.NDArray[np.float32]
COLLECTIVES = ("reduce_scatter", "allgather", "broadcast", "alltoall", "barrier")
TITLES = {"reduce_scatter": "Reduce_scatter", "allgather": "Allgather",
          "broadcast": "Broadcast", "alltoall": "Alltoall", "barrier": "Barrier"}
ALGORITHMS = ("auto", "ring", "bruck", "tree", "direct", "dissemination", "native")
ROOT = 0


def elements(collective: str, nbytes: int, p: int) -> int:
    """Element count of a ``nbytes`` float32 input (a multiple of ``p`` where needed)."""
    n = nbytes // 4
    if collective in ("reduce_scatter", "alltoall"):
        n = max(p, n - n % p)
    return n


def output_elements(collective: str, n: int, p: int) -> int:
    """Elements of the separate output buffer (0: the collective works in place)."""
    return {"reduce_scatter": n // p, "allgather": n * p, "alltoall": n}.get(collective, 0)


def check_data(collective: str, n: int, rank: int, p: int) -> tuple[F32, F32]:
    """The ``--check`` input of ``rank`` and the exact result it must receive."""
    if collective == "reduce_scatter":
        total = osu.ramp(n, 0.0) * np.float32(p) + np.float32(p * (p - 1) // 2)
        m = n // p
        return osu.ramp(n, rank), total[rank * m:(rank + 1) * m]
    if collective == "allgather":
        return osu.ramp(n, rank), np.concatenate([osu.ramp(n, j) for j in range(p)])
    if collective == "broadcast":
        mine = osu.ramp(n, 100.0) if rank == ROOT else np.full(n, -1.0, dtype=np.float32)
        return mine, osu.ramp(n, 100.0)
    if collective == "alltoall":
        m = n // p
        send = np.concatenate([osu.ramp(m, 16 * rank + j) for j in range(p)])
        want = np.concatenate([osu.ramp(m, 16 * j + rank) for j in range(p)])
        return send, want
    raise ValueError(f"no check for {collective!r}")


def make_op(rt: osu.Runtime, collective: str, x: F32, y: F32, algorithm: str
            ) -> tuple[Callable[[], object], F32]:
    """Return ``(op, result)``: one call of ``collective`` on input ``x`` (output ``y`` when
    the collective has a separate output) and the array holding its result."""
    result = x if collective == "broadcast" else y
    if isinstance(rt, osu.BitcollRuntime):
        comm = rt.comm
        algo = None if algorithm == "auto" else algorithm
        bitcoll_ops: dict[str, Callable[[], object]] = {
            "reduce_scatter": lambda: comm.reduce_scatter(x, out=y, algorithm=algo),
            "allgather": lambda: comm.allgather(x, out=y, algorithm=algo),
            "broadcast": lambda: comm.broadcast(x, root=ROOT, algorithm=algo),
            "alltoall": lambda: comm.alltoall(x, out=y, algorithm=algo),
            "barrier": lambda: comm.barrier(algorithm=algo),
        }
        return bitcoll_ops[collective], result
    if isinstance(rt, osu.MPIRuntime):
        mpi, mc = rt.MPI, rt.comm
        mpi_ops: dict[str, Callable[[], object]] = {
            "reduce_scatter": lambda: mc.Reduce_scatter_block(x, y, op=mpi.SUM),
            "allgather": lambda: mc.Allgather(x, y),
            "broadcast": lambda: mc.Bcast(x, root=ROOT),
            "alltoall": lambda: mc.Alltoall(x, y),
            "barrier": lambda: mc.Barrier(),
        }
        return mpi_ops[collective], result
    if isinstance(rt, osu.GlooRuntime):
        dist = rt.dist
        tx, ty = rt.torch.from_numpy(x), rt.torch.from_numpy(y)
        rs: Any = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        ag: Any = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gloo_ops: dict[str, Callable[[], object]] = {
            "reduce_scatter": lambda: rs(ty, tx),
            "allgather": lambda: ag(ty, tx),
            "broadcast": lambda: dist.broadcast(tx, src=ROOT),
            "alltoall": lambda: dist.all_to_all_single(ty, tx),
            "barrier": lambda: dist.barrier(),
        }
        return gloo_ops[collective], result
    raise TypeError(f"unsupported runtime {type(rt).__name__}")


def parse_collectives(spec: str) -> list[str]:
    """``"all"`` or a comma list of :data:`COLLECTIVES` (argparse type)."""
    names = list(COLLECTIVES) if spec.strip() == "all" else \
        [s.strip() for s in spec.split(",") if s.strip()]
    bad = [s for s in names if s not in COLLECTIVES]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"unknown collective(s) {bad or spec!r}; expected 'all' or a comma list of "
            f"{', '.join(COLLECTIVES)}")
    return names


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="OSU-style latency and bandwidth of bitcoll's reduce_scatter, allgather, "
                    "broadcast, alltoall and barrier (or mpi4py's / torch gloo's).")
    p.add_argument("--collective", type=parse_collectives, default=list(COLLECTIVES),
                   metavar="NAMES",
                   help=f"'all' (default) or a comma list of {', '.join(COLLECTIVES)}")
    osu.add_dense_args(p, ALGORITHMS,
                       "bitcoll algorithm (must exist for every collective measured)")
    osu.add_common_args(p, "1K:64M")
    return p


def run(args: argparse.Namespace, rt: osu.Runtime) -> None:
    """Measure every collective of ``args.collective`` at every size; print on rank 0."""
    schedule = osu.schedule_from_args(args)
    p = rt.size
    report = osu.Report(rt.rank, args.json)
    for coll in args.collective:
        what = {"barrier": "no data", "reduce_scatter": "float32, sum",
                "broadcast": f"float32, root {ROOT}"}.get(coll, "float32")
        legend = ("Size 0: a barrier moves no data (no bandwidth)" if coll == "barrier" else
                  "Size: bytes of each rank's input; latency over ranks; AlgBW = S / Avg "
                  f"(nccl-tests' S); BusBW = AlgBW * {_factor_text(coll)}; GB/s = 1e9 B/s; "
                  "CPU: process CPU time per call")
        osu.start_dense_table(report, rt, args, TITLES[coll], what, legend, collective=coll)
        if coll == "barrier":
            iters, warm = schedule.for_bytes(0)
            op, _ = make_op(rt, coll, np.empty(0, np.float32), np.empty(0, np.float32),
                            args.algorithm)
            t = osu.time_loop(rt, op, iters, warm)
            report.row(0, *osu.latency_values(t, args.full), None, None, t.cpu_us)
            continue
        for n in sorted({elements(coll, s, p) for s in args.sizes}):
            x: F32 = np.empty(n, dtype=np.float32)
            y: F32 = np.empty(output_elements(coll, n, p), dtype=np.float32)
            y.fill(0.0)  # touch every page before timing
            op, result = make_op(rt, coll, x, y, args.algorithm)
            check = check_data(coll, n, rt.rank, p) if args.check else None
            osu.measure_dense(rt, report, schedule, args.full, coll, x, op, result, check)
            del op, result, x, y, check
    report.finish()


def _factor_text(coll: str) -> str:
    return "1" if coll == "broadcast" else "(p-1)/p"


def check_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exit with status 2 for options that do not fit together (barrier alone takes any
    size: it has no data)."""
    osu.check_dense_args(ap, args, float32_sizes=any(c != "barrier" for c in args.collective))


def main(argv: list[str] | None = None) -> int:
    return osu.tool_main(parser(), argv, osu.open_dense_runtime, run, validate=check_args)


if __name__ == "__main__":
    sys.exit(main())
