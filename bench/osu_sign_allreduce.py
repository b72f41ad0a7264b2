"""OSU-style benchmark of bitcoll's packed-bit all-reduces: ``sign_allreduce`` (majority vote
and exact sign sum), ``quantized_allreduce`` and ``packed_sign_allreduce`` (votes already
packed, so its timings exclude packing and unpacking), optionally against the float32
all-reduce of the same vector on the same transport.

Usage::

    python -m launch -n 4 bench/osu_sign_allreduce.py -m 64M --compare-float32 \\
        --algorithm default,allgather --metrics
    mpiexec -n 4 python bench/osu_sign_allreduce.py --op majority,packed,sum,quantized -m 1K:16M
    python bench/osu_sign_allreduce.py -m 1M --check            # one rank

Sizes are element counts ``n`` (``-m``, same syntax as byte sizes, default 1K:64M). Variants,
measured one after another at each size in the same run:

* ``majority/<algo>``: ``comm.sign_allreduce(x, op="majority", tie=--tie)`` (int8 output),
* ``packed/<algo>``: ``comm.packed_sign_allreduce(bits, n, tie=--tie)``: the same majority
  on the votes of ``x`` packed beforehand (bit ``i`` = ``x[i] >= 0``), uint8 output packed
  the same way: the collective alone, without the packing and unpacking passes,
* ``sum/<algo>``: ``comm.sign_allreduce(x, op="sum")`` (int32 output),
* ``sign/<algo>``: ``comm.sign_allreduce(x, op="sign")`` (the exact sum's sign, int8),
* ``quantized<L>/<algo>``: ``comm.quantized_allreduce(q, L)`` with int8 ``q`` in
  ``[-L, L]`` (``--levels L``),
* ``quantized<L>-sign/<algo>`` (``--op qsign``): ``comm.quantized_allreduce(q, L,
  op="sign")`` (the sum's sign, int8: 2-bit signs instead of the sums in the all-gather),
* ``float32/allreduce``: ``comm.allreduce(x)`` of the float32 vector (``--compare-float32``),
* ``floor/pack+unpack`` (``--floor``): no communication, each rank only packs the signs of its
  float32 vector into bits and unpacks bits into its int8 output with bitcoll's kernels. Any
  sign all-reduce must at least read its input and write its output, so this row is the
  machine's lower bound for ``majority``: its ``Speedup`` is the most any sign all-reduce
  could gain over the float32 all-reduce on this machine (its Wire is 0),

for every ``<algo>`` of ``--algorithm`` (``default`` is the library's choice, or ``direct``,
``ring``, ``allgather``, ``hierarchical``: the two-level algorithm for hosts with several
ranks, the default there).

Output: one OSU-format table per variant (``# OSU-style Sign Allreduce Test: bitcoll
<variant>, ...``), whose rows start with ``Size``, the size in bytes of the float32 input
vector, ``4 n`` (so that OSU readers compare the variants with each other and with
``osu_allreduce.py``), then ``Avg Latency(us)`` averaged over ranks (with ``-f``, OSU's full
statistics: also its minimum and maximum over ranks and the iteration count). ``--metrics``
appends, one number per column: ``Elements`` (``n``), ``EffBW(GB/s)`` = ``4 n / Avg`` (GB/s =
1e9 B/s), ``Wire(B/rank)``: bytes each rank handed to the transport per call (headers
included, from ``comm.stats``; averaged over ranks), ``CPU(us)``: process CPU time (all
threads) per call averaged over ranks, and with ``--compare-float32`` ``Speedup`` = float32
average latency / this variant's. ``--json`` writes every column of every table (each row
also carries its ``Variant``; the tables carry ``meta.variant``).

Inputs are a fixed hash of (element index, rank): floats are integers in ``[-1000, 1000]``
(a few exact zeros), ``q`` is uniform in ``[-L, L]``. ``--check`` makes one extra call per
variant and size (not timed) and compares it with the exact result computed locally, in
chunks, from every rank's inputs.

Exit status 0, or 1 after an error or a failed check.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import osu

from bitcoll import kernels
from bitcoll.kernels import reference

OPS = ("majority", "packed", "sum", "sign", "quantized", "qsign")
MAJORITY_OPS = ("majority", "packed")
FLOOR = "floor"
ALGORITHMS = ("default", "direct", "ring", "allgather", "hierarchical")
TIES = ("positive", "negative", "alternate")
CHECK_CHUNK = 1 << 22


def columns(full: bool, metrics: bool, speedup: bool) -> list[osu.Column]:
    """A variant table's columns: OSU's (``full``: its -f statistics after the average), then
    the tool's own, printed with ``metrics`` (always in the JSON; ``Variant`` only there)."""
    cols = [osu.Column("Size", 12, "d"), *osu.latency_columns(full),
            osu.Column("Elements", 11, "d", shown=metrics),
            osu.Column("EffBW(GB/s)", 13, ".3f", shown=metrics),
            osu.Column("Wire(B/rank)", 15, ".0f", shown=metrics),
            osu.Column("CPU(us)", 14, ".0f", shown=metrics)]
    if speedup:
        cols.append(osu.Column("Speedup", 10, ".2f", shown=metrics))
    return [*cols, osu.Column("Variant", 22, "s", shown=False)]


# ----------------------------------------------------------------------------------- inputs


def _hash(rank: int, start: int, stop: int) -> npt.NDArray[np.uint64]:
    """32-bit mixing hash of (element index, rank) for indices ``[start, stop)``."""
    h = np.arange(start, stop, dtype=np.uint64)
    h *= np.uint64(0x9E3779B1)
    h += np.uint64((rank + 1) * 0x85EBCA77)
    h &= np.uint64(0xFFFFFFFF)
    h ^= h >> np.uint64(15)
    h *= np.uint64(0x2C1B3C6D)
    h &= np.uint64(0xFFFFFFFF)
    h ^= h >> np.uint64(12)
    return h


def float_votes(rank: int, start: int, stop: int) -> npt.NDArray[np.float32]:
    """Rank ``rank``'s float32 input at indices ``[start, stop)``: integers in
    ``[-1000, 1000]``."""
    return ((_hash(rank, start, stop) % np.uint64(2001)).astype(np.int32) - 1000) \
        .astype(np.float32)


def int_votes(rank: int, start: int, stop: int, levels: int) -> npt.NDArray[np.int8]:
    """Rank ``rank``'s quantized input at ``[start, stop)``: int8 uniform in
    ``[-levels, levels]`` (``levels <= 127``)."""
    q = (_hash(rank, start, stop) % np.uint64(2 * levels + 1)).astype(np.int16) - levels
    return q.astype(np.int8)


def fill(out: npt.NDArray[Any], make: Callable[[int, int], npt.NDArray[Any]]) -> None:
    """Fill ``out`` chunk by chunk with ``make(start, stop)``."""
    for a in range(0, out.size, CHECK_CHUNK):
        b = min(out.size, a + CHECK_CHUNK)
        out[a:b] = make(a, b)


# --------------------------------------------------------------------------------- variants


@dataclass(frozen=True)
class Variant:
    """One measured call: ``op`` in majority/sum/quantized/float32 and the algorithm."""

    op: str
    algorithm: str
    levels: int = 0

    @property
    def name(self) -> str:
        if self.op == "packed":
            return f"packed/{self.algorithm}"
        if self.op == "float32":
            return "float32/allreduce"
        if self.op == FLOOR:
            return "floor/pack+unpack"
        head = {"quantized": f"quantized{self.levels}",
                "qsign": f"quantized{self.levels}-sign"}.get(self.op, self.op)
        return f"{head}/{self.algorithm}"


def expected(v: Variant, p: int, start: int, stop: int, tie: str, call: int, rank: int
             ) -> npt.NDArray[Any]:
    """Exact result of ``v`` on rank ``rank`` at ``[start, stop)``; ``call`` is the
    communicator's count of earlier majority calls (for the alternate tie rule)."""
    if v.op == FLOOR:
        return np.where(float_votes(rank, start, stop) >= 0, 1, -1).astype(np.int8)
    if v.op == "packed":  # the majority, compared after unpacking
        return expected(Variant("majority", v.algorithm), p, start, stop, tie, call, rank)
    if v.op in ("quantized", "qsign"):
        acc = np.zeros(stop - start, dtype=np.int32)
        for r in range(p):
            acc += int_votes(r, start, stop, v.levels)
        return acc if v.op == "quantized" else np.sign(acc).astype(np.int8)
    if v.op == "float32":
        acc_f = np.zeros(stop - start, dtype=np.float32)
        for r in range(p):
            acc_f += float_votes(r, start, stop)
        return acc_f
    acc = np.zeros(stop - start, dtype=np.int32)
    for r in range(p):
        x = float_votes(r, start, stop)
        if v.op in ("sum", "sign"):
            acc += np.sign(x).astype(np.int32)
        else:
            acc += np.where(x >= 0, 1, -1).astype(np.int32)
    if v.op == "sum":
        return acc
    if v.op == "sign":
        return np.sign(acc).astype(np.int8)
    return reference.majority_of_sums(acc, tie, start + call)


class Bench:
    """The buffers and calls of one size; counts majority calls for the tie rule."""

    def __init__(self, rt: osu.BitcollRuntime, n: int, tie: str, ops: list[str],
                 levels: int) -> None:
        self.comm = rt.comm
        self.n, self.tie = n, tie
        self.x = np.empty(n, dtype=np.float32)
        fill(self.x, lambda a, b: float_votes(rt.rank, a, b))
        self.q = np.empty(n if "quantized" in ops or "qsign" in ops else 0, dtype=np.int8)
        fill(self.q, lambda a, b: int_votes(rt.rank, a, b, levels))
        self.out_i8 = np.zeros(n if {"majority", "sign", "qsign", FLOOR} & set(ops) else 0,
                               dtype=np.int8)
        self.bits = np.zeros(kernels.packed_nbytes(n) if FLOOR in ops else 0, dtype=np.uint8)
        packed = "packed" in ops
        self.votes = kernels.pack_signs(self.x) if packed else np.zeros(0, np.uint8)
        self.out_bits = np.zeros(kernels.packed_nbytes(n) if packed else 0, dtype=np.uint8)
        need_i32 = "sum" in ops or "quantized" in ops
        self.out_i32 = np.zeros(n if need_i32 else 0, dtype=np.int32)
        self.out_f32 = np.zeros(0, dtype=np.float32)

    def want_float32(self) -> None:
        self.out_f32 = np.zeros(self.n, dtype=np.float32)

    def op(self, v: Variant) -> tuple[Callable[[], object], npt.NDArray[Any]]:
        """Return ``(call, result array)`` of variant ``v``."""
        comm = self.comm
        algo = None if v.algorithm == "default" else v.algorithm
        x = self.x
        if v.op == "majority":
            o8, tie = self.out_i8, self.tie
            return (lambda: comm.sign_allreduce(x, op="majority", tie=tie, out=o8,
                                                algorithm=algo)), o8
        if v.op == "packed":
            votes, ob, n, tie = self.votes, self.out_bits, self.n, self.tie
            return (lambda: comm.packed_sign_allreduce(votes, n, tie=tie, out=ob,
                                                       algorithm=algo)), ob
        if v.op == "sum":
            o32 = self.out_i32
            return (lambda: comm.sign_allreduce(x, op="sum", out=o32, algorithm=algo)), o32
        if v.op == "sign":
            o8 = self.out_i8
            return (lambda: comm.sign_allreduce(x, op="sign", out=o8, algorithm=algo)), o8
        if v.op == "quantized":
            q, o32, lv = self.q, self.out_i32, v.levels
            return (lambda: comm.quantized_allreduce(q, lv, out=o32, algorithm=algo)), o32
        if v.op == "qsign":
            q, o8, lv = self.q, self.out_i8, v.levels
            return (lambda: comm.quantized_allreduce(q, lv, out=o8, op="sign",
                                                     algorithm=algo)), o8
        if v.op == FLOOR:
            o8, bits, n = self.out_i8, self.bits, self.n

            def local() -> None:
                kernels.pack_signs(x, out=bits)
                kernels.unpack_signs(bits, n, out=o8)
                comm.barrier()
            return local, o8
        of = self.out_f32
        return (lambda: comm.allreduce(x, out=of)), of


# ------------------------------------------------------------------------------------- main


def _list(choices: tuple[str, ...]) -> Callable[[str], list[str]]:
    def parse(spec: str) -> list[str]:
        names = [s.strip() for s in spec.split(",") if s.strip()]
        bad = [s for s in names if s not in choices]
        if bad or not names:
            raise argparse.ArgumentTypeError(
                f"expected a comma list of {', '.join(choices)}, got {spec!r}")
        return list(dict.fromkeys(names))
    return parse


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="OSU-style latency, effective bandwidth and wire bytes of bitcoll's "
                    "sign_allreduce and quantized_allreduce.")
    p.add_argument("--op", type=_list(OPS), default=["majority"], metavar="OPS",
                   help="comma list of majority, packed (majority on packed votes: "
                        "packed_sign_allreduce), sum, sign (the sum's sign), quantized, "
                        "qsign (quantized_allreduce op='sign') (default majority)")
    p.add_argument("--algorithm", type=_list(ALGORITHMS), default=["default"],
                   metavar="ALGOS",
                   help="comma list of default, direct, ring, allgather, hierarchical "
                        "(default: default)")
    p.add_argument("--levels", type=int, default=7,
                   help="quantized_allreduce levels L, inputs in [-L, L] (default 7)")
    p.add_argument("--tie", choices=TIES, default="alternate",
                   help="majority tie rule (default alternate)")
    p.add_argument("--compare-float32", action="store_true",
                   help="also time comm.allreduce of the float32 vector, print the speedup")
    p.add_argument("--floor", action="store_true",
                   help="also time the local work alone (pack signs, unpack the int8 output; "
                        "no communication): the lower bound of any sign all-reduce here")
    osu.add_backend_arg(p)
    osu.add_common_args(p, "1K:64M", size_unit="elements")
    return p


def run(args: argparse.Namespace, rt: osu.BitcollRuntime) -> None:
    """Measure every variant at every size; print one table per variant on rank 0."""
    schedule = osu.schedule_from_args(args)
    p = rt.size
    variants = [Variant(op, algo, args.levels if op in ("quantized", "qsign") else 0)
                for op in args.op for algo in args.algorithm]
    if args.floor:
        variants.insert(0, Variant(FLOOR, "local"))
    if args.compare_float32:
        variants.insert(0, Variant("float32", "allreduce"))
    rows: dict[str, list[tuple[Any, ...]]] = {v.name: [] for v in variants}
    majority_calls = 0
    for n in args.sizes:
        bench = Bench(rt, n, args.tie, args.op + ([FLOOR] if args.floor else []),
                      args.levels)
        if args.compare_float32:
            bench.want_float32()
        iters, warm = schedule.for_bytes(4 * n)
        f32_us: float | None = None
        for v in variants:
            op, result = bench.op(v)
            if args.check:
                op()
                ok = True
                for a in range(0, n, CHECK_CHUNK):
                    b = min(n, a + CHECK_CHUNK)
                    want = expected(v, p, a, b, args.tie, majority_calls, rt.rank)
                    got = result[a:b] if v.op != "packed" else \
                        kernels.unpack_signs(result, n)[a:b]
                    ok = ok and bool(np.array_equal(got, want))
                if v.op in MAJORITY_OPS:
                    majority_calls += 1
                osu.agree(rt, ok, f"{v.name} of {n} elements")
            t = osu.time_loop(rt, op, iters, warm)
            if v.op in MAJORITY_OPS:
                majority_calls += iters + warm
            if v.op == "float32":
                f32_us = t.avg_us
            row: tuple[Any, ...] = (4 * n, *osu.latency_values(t, args.full), n,
                                    osu.gbps(4 * n, t.avg_us * 1e-6), t.wire_bytes, t.cpu_us)
            if args.compare_float32:
                row += (None if f32_us is None else f32_us / t.avg_us,)
            rows[v.name].append((*row, v.name))
        del bench
    report = osu.Report(rt.rank, args.json)
    for v in variants:
        report.start(f"OSU-style Sign Allreduce Test: bitcoll {v.name}, backend {rt.backend}, "
                     f"{osu.ranks(p)}",
                     [f"tie {args.tie}; {rt.describe()}",
                      "Size: bytes of the float32 input vector (4 * Elements); latency "
                      "averaged over ranks"
                      + ("; EffBW = Size / Avg (GB/s = 1e9 B/s); Wire: bytes sent per rank "
                         "per call (headers included); CPU: process CPU time per call"
                         + ("; Speedup = float32 Avg / Avg" if args.compare_float32 else "")
                         if args.metrics else "")],
                     columns(args.full, args.metrics, args.compare_float32),
                     backend=rt.backend, ranks=p, tie=args.tie, collective="sign_allreduce",
                     variant=v.name)
        for r in rows[v.name]:
            report.row(*r)
    report.finish()


def check_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exit with status 2 for levels outside int8 and empty vectors."""
    if not 1 <= args.levels <= 127:
        ap.error("--levels must be in [1, 127] (int8 inputs)")
    if 0 in args.sizes:
        ap.error("sizes are element counts here and must be >= 1")


def open_bitcoll(args: argparse.Namespace) -> osu.BitcollRuntime:
    """bitcoll's runtime on ``--backend`` (the only implementation of these collectives)."""
    return osu.BitcollRuntime(backend=args.backend, timeout=args.timeout)


def main(argv: list[str] | None = None) -> int:
    return osu.tool_main(parser(), argv, open_bitcoll, run, validate=check_args)


if __name__ == "__main__":
    sys.exit(main())
