"""Shared harness of bitcoll's OSU-style benchmark tools.

The tools (``osu_allreduce.py``, ``osu_collectives.py``, ``osu_sign_allreduce.py``) are run on
every rank of a job, under ``python -m launch -n N`` (bitcoll over TCP, torch gloo), under
``mpiexec -n N`` (bitcoll over MPI, mpi4py) or as a plain one-rank process. This module holds
what they share:

* **Sizes**: :func:`parse_sizes` reads ``"1K:256M"`` (powers of two from 1 KiB to 256 MiB),
  ``"1K:256M:4"`` (every fourth power), ``"64M"`` or comma lists of those. Suffixes K, M, G
  are binary (KiB, MiB, GiB); the same syntax gives element counts where a tool asks for them.
* **Iterations**: :class:`Schedule` shrinks the iteration and warm-up counts with the message
  size so that every size moves about the same number of bytes (``--iter-bytes``), between
  ``--min-iterations`` and ``--iterations``.
* **Timing** (:func:`time_loop`): warm-up calls, a barrier, then one timed loop of
  ``iterations`` calls. A rank's latency is its loop time divided by the iteration count;
  the table shows the average of that latency over the ranks (gathered after the loop,
  outside the timed region), and ``CPU(us)``: the process CPU time (all threads, user +
  system) per call averaged over ranks, a figure that other load on the machine hardly
  changes. With ``-f``/``--full`` (OSU's full statistics) the minimum and maximum latency
  over the ranks and the iteration count follow the average, in OSU's column order
  (:func:`latency_columns`): ``Size  Avg Latency(us)  Min Latency(us)  Max Latency(us)
  Iterations``.
* **Element sizes**: a byte size that is not a whole number of the tool's elements is
  rejected (:func:`check_whole_elements`, exit status 2), never rounded.
* **Bandwidth**, as nccl-tests defines it: ``AlgBW = S / t`` with ``S`` the collective's data
  size (:func:`data_bytes`) and ``t`` the average latency, and ``BusBW = AlgBW * factor``
  (:func:`bus_factor`: ``2 (p - 1) / p`` for all-reduce, ``(p - 1) / p`` for reduce-scatter,
  all-gather and all-to-all, 1 for broadcast). GB/s are 10^9 bytes per second.
* **Output** (:class:`Report`, rank 0 only): OSU-format text tables: comment lines starting
  with ``#`` (the last one names the columns), then one row per size whose first column is
  the size in bytes and whose other columns hold one number each (a missing value is ``-``);
  columns are separated by at least two spaces in the header and by whitespace in the rows.
  By default a row has exactly OSU's columns: ``Size  Avg Latency(us)``, and with
  ``-f``/``--full`` also ``Min Latency(us)  Max Latency(us)  Iterations``. ``--metrics``
  appends the tool's own columns after OSU's (bandwidth, CPU time, bytes on the wire, ...);
  ``--json PATH`` always writes every column, those included, read back by
  :func:`load_tables` (the text by :func:`parse_tables`). Under the launcher, ``--no-prefix``
  (or :func:`strip_rank_prefix`) leaves output that any OSU-format reader takes.
* **Runtimes** (:class:`Runtime`): the process group a tool measures with: bitcoll
  (:func:`bitcoll.init`, backend chosen from the environment), mpi4py's ``COMM_WORLD`` or
  torch.distributed with gloo.
* **Checks** (``--check``): tools validate the result once per size; :func:`agree` makes the
  verdict collective so that every rank stops together with :class:`CheckError`.

Errors: bad command-line values are reported by argparse (exit status 2); a failed check
raises :class:`CheckError` on every rank; :func:`run_tool` turns any error into exit status 1
after aborting the job's process group, so that no rank is left waiting.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import sys
import time
import traceback
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from launch.__main__ import free_ports

__all__ = [
    "CheckError",
    "Column",
    "Report",
    "Runtime",
    "BitcollRuntime",
    "MPIRuntime",
    "GlooRuntime",
    "Schedule",
    "Table",
    "Timing",
    "IMPLS",
    "add_common_args",
    "add_backend_arg",
    "add_dense_args",
    "agree",
    "check_dense_args",
    "check_once",
    "check_whole_elements",
    "dense_columns",
    "fmt_bytes",
    "free_port",
    "open_dense_runtime",
    "ramp",
    "latency_columns",
    "latency_values",
    "load_tables",
    "measure_dense",
    "start_dense_table",
    "bus_factor",
    "data_bytes",
    "gbps",
    "run_tool",
    "tool_main",
    "open_runtime",
    "parse_size",
    "parse_sizes",
    "parse_tables",
    "strip_rank_prefix",
    "ranks",
    "schedule_from_args",
    "sizes_arg",
    "time_loop",
]

F32 = npt.NDArray[np.float32]
F64 = npt.NDArray[np.float64]
R = TypeVar("R", bound="Runtime")
IMPLS = ("bitcoll", "mpi4py", "gloo")
_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
MISSING = "-"
#: The launcher prefixes every line of a rank's output with this.
_RANK_PREFIX = re.compile(r"^\[rank \d+\] ")


class CheckError(RuntimeError):
    """A collective returned a wrong result under ``--check`` (raised on every rank)."""


# ------------------------------------------------------------------------------------ sizes


def display_command(cmd: Sequence[str]) -> list[str]:
    """``cmd`` as a reader would type it in the repository root: this interpreter as
    ``python``, an ``mpiexec`` by name, paths inside the repository relative to it."""
    root = str(Path(__file__).resolve().parents[1])
    out = []
    for arg in cmd:
        if arg == sys.executable:
            out.append("python")
        elif Path(arg).name == "mpiexec":
            out.append("mpiexec")
        elif arg.startswith(root + os.sep):
            out.append(os.path.relpath(arg, root))
        else:
            out.append(arg)
    return out


def parse_size(text: str) -> int:
    """Parse ``"4096"``, ``"4K"``, ``"256M"``, ``"1G"`` (binary suffixes, optional ``iB``/``B``,
    case-insensitive) into an integer >= 0. Raises ValueError on anything else."""
    m = re.fullmatch(r"\s*(\d+)\s*([kKmMgG]?)(?:i?[bB])?\s*", text)
    if m is None:
        raise ValueError(f"not a size: {text!r} (expected e.g. 1024, 1K, 256M, 1G)")
    return int(m.group(1)) * _SUFFIX[m.group(2).upper()]


def parse_sizes(spec: str) -> list[int]:
    """Parse a size list: comma-separated items, each ``SIZE`` or ``LO:HI`` (LO, 2 LO, 4 LO ...
    up to HI inclusive) or ``LO:HI:FACTOR``. Returns the sizes sorted, without duplicates.

    >>> parse_sizes("1K:8K,64")
    [64, 1024, 2048, 4096, 8192]

    Raises ValueError for an empty list, LO > HI, LO = 0 in a range, or FACTOR < 2.
    """
    out: set[int] = set()
    for item in spec.split(","):
        item = item.strip()
        if not item:
            continue
        parts = item.split(":")
        if len(parts) == 1:
            out.add(parse_size(parts[0]))
            continue
        if len(parts) not in (2, 3):
            raise ValueError(f"bad size range {item!r} (expected LO:HI or LO:HI:FACTOR)")
        lo, hi = parse_size(parts[0]), parse_size(parts[1])
        factor = int(parts[2]) if len(parts) == 3 else 2
        if lo < 1 or lo > hi:
            raise ValueError(f"bad size range {item!r}: need 1 <= LO <= HI")
        if factor < 2:
            raise ValueError(f"bad size range {item!r}: FACTOR must be >= 2")
        s = lo
        while s <= hi:
            out.add(s)
            s *= factor
    if not out:
        raise ValueError(f"empty size list {spec!r}")
    return sorted(out)


def sizes_arg(spec: str) -> list[int]:
    """argparse ``type=`` wrapper of :func:`parse_sizes` with a readable error message."""
    try:
        return parse_sizes(spec)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def ranks(p: int) -> str:
    """``"1 rank"``, ``"4 ranks"``."""
    return f"{p} rank" if p == 1 else f"{p} ranks"


def fmt_bytes(n: float) -> str:
    """``n`` bytes in decimal units for reports: bitcoll's
    :func:`~bitcoll.transport.base.format_bytes` (imported when first used, as bitcoll is)."""
    from bitcoll.transport.base import format_bytes

    return format_bytes(n)


# ------------------------------------------------------------------------------- iterations


@dataclass(frozen=True)
class Schedule:
    """Iteration and warm-up counts as a function of the message size.

    A size of ``nbytes`` runs ``clamp(iter_bytes // nbytes, min_iterations, iterations)``
    timed iterations and ``ceil(warmup * timed / iterations)`` warm-up calls (at least 1 when
    ``warmup >= 1``): small messages run ``iterations`` times, large ones move about
    ``iter_bytes`` bytes.
    """

    iterations: int = 100
    warmup: int = 10
    min_iterations: int = 3
    iter_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        if self.iterations < 1 or self.min_iterations < 1:
            raise ValueError("iteration counts must be >= 1")
        if self.warmup < 0:
            raise ValueError("warmup must be >= 0")
        if self.iter_bytes < 1:
            raise ValueError("iter_bytes must be >= 1")

    def for_bytes(self, nbytes: int) -> tuple[int, int]:
        """Return ``(iterations, warmup)`` for a message of ``nbytes`` bytes."""
        budget = self.iter_bytes // max(1, nbytes)
        iters = min(self.iterations, max(self.min_iterations, budget))
        warm = 0 if self.warmup == 0 else max(1, math.ceil(self.warmup * iters / self.iterations))
        return iters, min(warm, self.warmup)


def add_common_args(parser: argparse.ArgumentParser, default_sizes: str,
                    size_unit: str = "bytes") -> None:
    """Add the options every tool shares (sizes, iteration schedule, --json, --check,
    --timeout)."""
    parser.add_argument("-m", "--sizes", type=sizes_arg, default=parse_sizes(default_sizes),
                        metavar="SPEC",
                        help=f"message sizes in {size_unit}: LO:HI (powers of two), LO:HI:F, "
                             f"or comma lists; K/M/G are binary (default {default_sizes})")
    parser.add_argument("-i", "--iterations", type=int, default=100,
                        help="timed iterations for small messages (default 100)")
    parser.add_argument("-x", "--warmup", type=int, default=10,
                        help="warm-up calls for small messages (default 10)")
    parser.add_argument("--min-iterations", type=int, default=3,
                        help="fewest timed iterations at any size (default 3)")
    parser.add_argument("--iter-bytes", type=parse_size, default=1 << 30, metavar="SIZE",
                        help="about this many bytes are timed per size; iterations shrink "
                             "with the message size (default 1G)")
    parser.add_argument("--json", metavar="PATH", default=None,
                        help="also write the tables as JSON to PATH (rank 0)")
    parser.add_argument("-c", "--check", action="store_true",
                        help="validate the result once per size (not timed)")
    parser.add_argument("-f", "--full", action="store_true",
                        help="full statistics (as OSU's -f): also the minimum and maximum "
                             "latency over the ranks and the iteration count")
    parser.add_argument("--metrics", action="store_true",
                        help="also print the tool's own columns (bandwidth, CPU time, ...) "
                             "after OSU's; --json always has them")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="deadline in seconds of every collective and of the set-up "
                             "(bitcoll and gloo; default 300)")


def add_dense_args(parser: argparse.ArgumentParser, algorithms: Sequence[str],
                   algorithm_help: str) -> None:
    """Add the options of the dense float32 tools (``osu_allreduce.py``,
    ``osu_collectives.py``): ``--impl``, ``--algorithm`` (one of ``algorithms``),
    ``--backend`` and ``--gloo-port-offset``."""
    parser.add_argument("--impl", choices=IMPLS, default="bitcoll",
                        help="implementation to measure (default bitcoll)")
    parser.add_argument("--algorithm", choices=algorithms, default="auto",
                        help=algorithm_help)
    add_backend_arg(parser)
    parser.add_argument("--gloo-port-offset", type=int, default=0,
                        help="gloo listens on MASTER_PORT + this (default 0)")


def add_backend_arg(parser: argparse.ArgumentParser) -> None:
    """Add ``--backend``: bitcoll's backend (auto, tcp, mpi, local)."""
    parser.add_argument("--backend", choices=("auto", "tcp", "mpi", "local"), default="auto",
                        help="bitcoll backend (default: from the environment)")


def check_dense_args(parser: argparse.ArgumentParser, args: argparse.Namespace,
                     float32_sizes: bool = True) -> None:
    """Exit with status 2 (``parser.error``) when :func:`add_dense_args`' options do not fit
    together, or (``float32_sizes``) when a size is not a whole number of float32
    elements."""
    if args.impl != "bitcoll" and (args.algorithm != "auto" or args.backend != "auto"):
        parser.error("--algorithm and --backend apply to --impl bitcoll only")
    if float32_sizes:
        check_whole_elements(parser, args.sizes, 4, "float32")


def dense_columns(full: bool, metrics: bool = False) -> list[Column]:
    """The table columns of the dense tools: Size, the latency columns (``full``: OSU's -f
    statistics after the average), then AlgBW, BusBW and CPU (printed only with
    ``metrics``; always in the JSON)."""
    return [Column("Size", 10, "d"), *latency_columns(full),
            Column("AlgBW(GB/s)", 14, ".3f", shown=metrics),
            Column("BusBW(GB/s)", 14, ".3f", shown=metrics),
            Column("CPU(us)", 14, ".0f", shown=metrics)]


def ramp(n: int, offset: float) -> F32:
    """The ``--check`` inputs of the dense tools: ``(i mod 13) + offset`` for ``i < n``,
    float32 (small integers, so that sums are exact)."""
    x = (np.arange(n, dtype=np.int32) % 13).astype(np.float32)
    x += np.float32(offset)
    return x


def check_whole_elements(parser: argparse.ArgumentParser, sizes: Sequence[int],
                         itemsize: int, dtype: str) -> None:
    """Exit with status 2 (``parser.error``) unless every byte size in ``sizes`` is a
    positive whole number of ``itemsize``-byte ``dtype`` elements."""
    for s in sizes:
        if s < itemsize or s % itemsize:
            parser.error(f"size {s} bytes is not a whole number of {dtype} elements "
                         f"({itemsize} bytes each); use a positive multiple of {itemsize}")


def latency_columns(full: bool) -> list[Column]:
    """The latency columns in OSU's order: the average, and with ``full`` (``-f``) the
    minimum, the maximum (over ranks, microseconds) and the iteration count."""
    cols = [Column("Avg Latency(us)", 18, ".2f")]
    if full:
        cols += [Column("Min Latency(us)", 18, ".2f"), Column("Max Latency(us)", 18, ".2f"),
                 Column("Iterations", 12, "d")]
    return cols


def latency_values(t: Timing, full: bool) -> list[Any]:
    """The cells of :func:`latency_columns` for ``t``."""
    return [t.avg_us, t.min_us, t.max_us, t.iterations] if full else [t.avg_us]


def schedule_from_args(args: argparse.Namespace) -> Schedule:
    """The :class:`Schedule` of the parsed common options (ValueError if inconsistent)."""
    return Schedule(iterations=args.iterations, warmup=args.warmup,
                    min_iterations=min(args.min_iterations, args.iterations),
                    iter_bytes=args.iter_bytes)


# --------------------------------------------------------------------------------- runtimes


class Runtime(ABC):
    """The process group a benchmark runs on: rank, size, a barrier and a small all-gather
    used for the statistics (never inside a timed loop)."""

    impl: str = "abstract"
    #: What the table header calls the backend ("tcp", "mpi", "local", "mpi4py", "gloo").
    backend: str = "abstract"
    rank: int = 0
    size: int = 1

    @abstractmethod
    def barrier(self) -> None:
        """Return once every rank has entered the barrier."""

    @abstractmethod
    def gather(self, values: Sequence[float]) -> F64:
        """All-gather ``values`` (same length ``k`` on every rank): a ``(size, k)`` float64
        array, row ``r`` from rank ``r``, on every rank."""

    def bytes_sent(self) -> int | None:
        """Bytes this rank has sent so far (bitcoll's counters), or None if not counted."""
        return None

    def describe(self) -> str:
        """One line of version information for the table header."""
        return ""

    @abstractmethod
    def abort(self, reason: str) -> None:
        """Make every rank fail promptly (called when this rank fails alone)."""

    @abstractmethod
    def close(self) -> None:
        """Release the process group. Idempotent."""


class BitcollRuntime(Runtime):
    """A :class:`bitcoll.Communicator` (``comm`` is public for the tools)."""

    impl = "bitcoll"

    def __init__(self, backend: str = "auto", timeout: float = 300.0) -> None:
        import bitcoll

        self.comm = bitcoll.init(backend=backend, timeout=timeout)
        self.backend = self.comm.backend
        self.rank, self.size = self.comm.rank, self.comm.size
        self._closed = False

    def barrier(self) -> None:
        self.comm.barrier()

    def gather(self, values: Sequence[float]) -> F64:
        vec = np.asarray(values, dtype=np.float64).reshape(-1)
        out: F64 = self.comm.allgather(vec)
        return out.reshape(self.size, vec.size)

    def bytes_sent(self) -> int:
        return int(self.comm.stats.bytes_sent)

    def describe(self) -> str:
        import bitcoll

        return f"bitcoll {bitcoll.__version__}"

    def abort(self, reason: str) -> None:
        if self.size > 1 and self.comm.transport.failure is None:
            self.comm.transport.abort(reason)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.comm.close()


class MPIRuntime(Runtime):
    """mpi4py's ``COMM_WORLD`` (``comm`` is public for the tools). MPI calls have no deadline:
    run under an outer time limit."""

    impl = "mpi4py"
    backend = "mpi4py"

    def __init__(self) -> None:
        from mpi4py import MPI

        self.MPI = MPI
        self.comm = MPI.COMM_WORLD
        self.rank, self.size = int(self.comm.Get_rank()), int(self.comm.Get_size())

    def barrier(self) -> None:
        self.comm.Barrier()

    def gather(self, values: Sequence[float]) -> F64:
        vec = np.asarray(values, dtype=np.float64).reshape(-1)
        out = np.empty((self.size, vec.size), dtype=np.float64)
        self.comm.Allgather(vec, out)
        return out

    def describe(self) -> str:
        import mpi4py

        lib = " ".join(str(self.MPI.Get_library_version()).strip().splitlines()[0].split())
        return f"mpi4py {mpi4py.__version__}, {lib}"

    def abort(self, reason: str) -> None:
        print(f"rank {self.rank}: aborting the MPI job: {reason}", file=sys.stderr, flush=True)
        self.comm.Abort(1)

    def close(self) -> None:
        """MPI is finalized at exit by mpi4py."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (the launcher's
    :func:`launch.__main__.free_ports`, the one port helper of the benchmarks)."""
    return free_ports(host)[0]


class GlooRuntime(Runtime):
    """torch.distributed with the gloo backend, set up from the launcher's environment
    (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` plus ``port_offset``), or a
    one-rank group on a free loopback port when those are not set."""

    impl = "gloo"
    backend = "gloo"

    def __init__(self, timeout: float = 300.0, port_offset: int = 0) -> None:
        import torch
        import torch.distributed as dist

        self.torch = torch
        self.dist = dist
        env = os.environ
        if all(env.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
            rank, size = int(env["RANK"]), int(env["WORLD_SIZE"])
            addr, port = env["MASTER_ADDR"], int(env["MASTER_PORT"]) + port_offset
        else:
            rank, size, addr, port = 0, 1, "127.0.0.1", free_port()
        host = f"[{addr}]" if ":" in addr else addr
        dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=rank,
                                world_size=size,
                                timeout=datetime.timedelta(seconds=timeout))
        self.rank, self.size = rank, size
        self._closed = False

    def barrier(self) -> None:
        self.dist.barrier()

    def gather(self, values: Sequence[float]) -> F64:
        t = self.torch.tensor(list(values), dtype=self.torch.float64)
        parts = [self.torch.empty_like(t) for _ in range(self.size)]
        self.dist.all_gather(parts, t)
        return np.stack([p.numpy() for p in parts]).astype(np.float64)

    def describe(self) -> str:
        return f"torch {self.torch.__version__}"

    def abort(self, reason: str) -> None:
        print(f"rank {self.rank}: aborting: {reason}", file=sys.stderr, flush=True)
        os._exit(1)  # gloo has no abort: exiting breaks the peers' connections

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.dist.destroy_process_group()


def open_runtime(impl: str, *, backend: str = "auto", timeout: float = 300.0,
                 port_offset: int = 0) -> Runtime:
    """Create the runtime of ``impl`` ("bitcoll", "mpi4py" or "gloo"); ``backend`` is
    bitcoll's, ``port_offset`` is added to ``MASTER_PORT`` for gloo. ValueError for an unknown
    impl."""
    if impl == "bitcoll":
        return BitcollRuntime(backend=backend, timeout=timeout)
    if impl == "mpi4py":
        return MPIRuntime()
    if impl == "gloo":
        return GlooRuntime(timeout=timeout, port_offset=port_offset)
    raise ValueError(f"unknown impl {impl!r}; expected one of {', '.join(IMPLS)}")


def open_dense_runtime(args: argparse.Namespace) -> Runtime:
    """The runtime that :func:`add_dense_args`' parsed options (and ``--timeout``) ask for."""
    return open_runtime(args.impl, backend=args.backend, timeout=args.timeout,
                        port_offset=args.gloo_port_offset)


def agree(rt: Runtime, ok: bool, what: str) -> None:
    """Collective verdict of a check: raise :class:`CheckError` on every rank if ``ok`` is
    False on any rank (naming the failing ranks)."""
    flags = rt.gather([1.0 if ok else 0.0])[:, 0]
    bad = [r for r in range(rt.size) if flags[r] < 0.5]
    if bad:
        raise CheckError(f"check failed: {what} (wrong result on ranks {bad})")


# ----------------------------------------------------------------------------------- timing


@dataclass(frozen=True)
class Timing:
    """Latencies of one measured loop in microseconds, reduced over ranks; the average over
    ranks of the process CPU time (user + system, all threads) per call in microseconds; and
    the average over ranks of the bytes each rank sent per call (None when the runtime does
    not count)."""

    avg_us: float
    min_us: float
    max_us: float
    iterations: int
    cpu_us: float = 0.0
    wire_bytes: float | None = None


def time_loop(rt: Runtime, op: Callable[[], object], iterations: int, warmup: int) -> Timing:
    """Run ``op`` ``warmup`` times, then a barrier, then time ``iterations`` calls.

    Each rank's latency is its loop time / ``iterations``; the returned figures are the mean,
    minimum and maximum of that over the ranks. CPU: the process's CPU time
    (``time.process_time``: every thread, user and system) during the loop per call, averaged
    over ranks; it includes busy-polling (MPICH spins while it waits) and, unlike latency, it
    hardly depends on other load on the machine. Wire bytes: the growth of
    :meth:`Runtime.bytes_sent` during the timed loop per call, averaged over ranks.
    """
    for _ in range(warmup):
        op()
    rt.barrier()
    sent0 = rt.bytes_sent()
    c0 = time.process_time()
    t0 = time.perf_counter()
    for _ in range(iterations):
        op()
    elapsed = time.perf_counter() - t0
    cpu = time.process_time() - c0
    sent1 = rt.bytes_sent()
    wire = float("nan") if sent0 is None or sent1 is None else (sent1 - sent0) / iterations
    stats = rt.gather([elapsed / iterations * 1e6, cpu / iterations * 1e6, wire])
    lat = stats[:, 0]
    wire_avg = None if sent0 is None else float(stats[:, 2].mean())
    return Timing(float(lat.mean()), float(lat.min()), float(lat.max()), iterations,
                  float(stats[:, 1].mean()), wire_avg)


def bus_factor(collective: str, p: int) -> float:
    """nccl-tests' bus-bandwidth factor of ``collective`` on ``p`` ranks (0 for barrier)."""
    if collective in ("allreduce", "sign_allreduce", "quantized_allreduce"):
        return 2.0 * (p - 1) / p
    if collective in ("reduce_scatter", "allgather", "alltoall"):
        return (p - 1) / p
    if collective == "broadcast":
        return 1.0
    if collective == "barrier":
        return 0.0
    raise ValueError(f"unknown collective {collective!r}")


def data_bytes(collective: str, nbytes: int, p: int) -> int:
    """nccl-tests' data size ``S`` of ``collective`` when each rank's input buffer holds
    ``nbytes``: the whole gathered output for all-gather, the input buffer otherwise."""
    return nbytes * p if collective == "allgather" else nbytes


def start_dense_table(report: Report, rt: Runtime, args: argparse.Namespace, test: str,
                      what: str, legend: str, **meta: Any) -> None:
    """Start a dense tool's table (:func:`add_dense_args`' options in ``args``): title
    ``bitcoll OSU-style <test> Test, backend B, N ranks``, the comments ``impl I, algorithm A,
    <what>`` (plus the runtime's description) and ``legend``, the :func:`dense_columns`, and
    the JSON metadata impl, backend, ranks, algorithm and ``meta``."""
    algo = args.algorithm if args.impl == "bitcoll" else "-"
    info = rt.describe()
    report.start(f"bitcoll OSU-style {test} Test, backend {rt.backend}, {ranks(rt.size)}",
                 [f"impl {args.impl}, algorithm {algo}, {what}" + (f", {info}" if info else ""),
                  legend],
                 dense_columns(args.full, getattr(args, "metrics", False)), impl=args.impl,
                 backend=rt.backend, ranks=rt.size, algorithm=algo, **meta)


def check_once(rt: Runtime, op: Callable[[], object], x: F32, result: F32,
               check: tuple[F32, F32] | None, what: str) -> None:
    """With ``check = (input, expected)``: copy ``input`` into ``x``, run ``op`` once and
    require ``expected`` in ``result`` on every rank (:func:`agree`, CheckError naming
    ``what``). Then, checked or not, zero ``x`` for the timed calls."""
    if check is not None:
        given, want = check
        np.copyto(x, given)
        op()
        agree(rt, bool(np.array_equal(result, want)), what)
    x.fill(0.0)


def measure_dense(rt: Runtime, report: Report, schedule: Schedule, full: bool,
                  collective: str, x: F32, op: Callable[[], object], result: F32,
                  check: tuple[F32, F32] | None = None) -> None:
    """One row of a dense tool's table (:func:`dense_columns`) for ``op``, one call of
    ``collective`` on the float32 input ``x`` that leaves its result in ``result``.

    With ``check = (input, expected)``, ``op`` first runs once on ``input`` and every rank
    must find ``expected`` in ``result`` (:func:`agree`). Then ``x`` is zeroed and ``op`` timed
    (:func:`time_loop`, iterations from ``schedule`` for nccl-tests' data size); the row is
    the input size, the latency, AlgBW, BusBW and the CPU time per call."""
    nbytes = x.nbytes
    check_once(rt, op, x, result, check, f"{collective} of {nbytes} bytes")
    data = data_bytes(collective, nbytes, rt.size)
    iters, warm = schedule.for_bytes(data)
    t = time_loop(rt, op, iters, warm)
    alg = gbps(data, t.avg_us * 1e-6)
    report.row(nbytes, *latency_values(t, full), alg, alg * bus_factor(collective, rt.size),
               t.cpu_us)


def gbps(nbytes: float, seconds: float) -> float:
    """``nbytes / seconds`` in GB/s (10^9 bytes per second); 0 for a zero time."""
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


# ----------------------------------------------------------------------------------- output


@dataclass(frozen=True)
class Column:
    """A table column: ``name`` (no double spaces), printed ``width`` wide with ``fmt``
    (a format spec such as ``".2f"`` or ``"d"``); the first column is left-aligned. A column
    with ``shown=False`` is recorded in the JSON but not printed (the text keeps OSU's
    columns)."""

    name: str
    width: int
    fmt: str = ""
    shown: bool = True


@dataclass
class Table:
    """One OSU-style table: comment lines (title first) and rows of values by column name."""

    title: str
    comments: list[str]
    columns: list[str]
    rows: list[dict[str, Any]] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)


class Report:
    """Prints tables on rank 0 as rows arrive and writes them as JSON at :meth:`finish`.

    ``print_fn`` defaults to ``print`` with flush; other ranks print nothing.
    """

    def __init__(self, rank: int, json_path: str | None = None,
                 print_fn: Callable[[str], None] | None = None) -> None:
        self.rank = rank
        self.json_path = json_path
        self._print = print_fn or (lambda s: print(s, flush=True))
        self.tables: list[Table] = []
        self._columns: list[Column] = []

    def _emit(self, line: str) -> None:
        if self.rank == 0:
            self._print(line)

    def start(self, title: str, comments: Sequence[str], columns: Sequence[Column],
              **meta: Any) -> None:
        """Begin a table: print the title (``# ...``), the comments and the column header."""
        self._columns = [Column(c.name, max(c.width, len(c.name) + 2), c.fmt, c.shown)
                         for c in columns]
        if not self._columns[0].shown:
            raise ValueError("the first column (the size) must be shown")
        table = Table(title, list(comments), [c.name for c in self._columns], meta=dict(meta))
        if self.tables:
            self._emit("")
        self.tables.append(table)
        self._emit(f"# {title}")
        for c in comments:
            self._emit(f"# {c}")
        first, *rest = [c for c in self._columns if c.shown]
        head = "# " + first.name.ljust(first.width - 2)
        head += "".join(c.name.rjust(c.width) for c in rest)
        self._emit(head)

    def row(self, *values: Any) -> None:
        """Print one row (values in column order; None prints ``-``) and record it."""
        if len(values) != len(self._columns):
            raise ValueError(f"row has {len(values)} values for {len(self._columns)} columns")
        cells = []
        record: dict[str, Any] = {}
        for i, (col, v) in enumerate(zip(self._columns, values, strict=True)):
            text = MISSING if v is None else format(v, col.fmt)
            if not text or any(ch.isspace() for ch in text):
                raise ValueError(f"cell {text!r} of column {col.name!r} is empty or has spaces")
            record[col.name] = None if v is None else _plain(v)
            if not col.shown:
                continue
            if i == 0:
                cells.append(text.ljust(col.width))
            else:
                cells.append(text.rjust(col.width) if len(text) < col.width else " " + text)
        self.tables[-1].rows.append(record)
        self._emit("".join(cells).rstrip())

    def note(self, text: str) -> None:
        """Print a comment line (``# text``) below the current table and keep it in its
        comments."""
        if self.tables:
            self.tables[-1].comments.append(text)
        self._emit(f"# {text}")

    def finish(self) -> None:
        """Write the JSON file (rank 0, when a path was given)."""
        if self.rank != 0 or not self.json_path:
            return
        doc = [{"title": t.title, "comments": t.comments, "columns": t.columns,
                "meta": t.meta, "rows": t.rows} for t in self.tables]
        with open(self.json_path, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")


def load_tables(path: str | os.PathLike[str]) -> list[Table]:
    """The tables of a ``--json`` file (:meth:`Report.finish`)."""
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    return [Table(t["title"], list(t["comments"]), list(t["columns"]), list(t["rows"]),
                  dict(t.get("meta", {}))) for t in doc]


def _plain(v: Any) -> Any:
    if isinstance(v, (bool, np.bool_)):
        return bool(v)
    if isinstance(v, (int, np.integer)):
        return int(v)
    if isinstance(v, (float, np.floating)):
        return float(v)
    return str(v)


def _cell(text: str) -> Any:
    if text == MISSING:
        return None
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text


def strip_rank_prefix(text: str) -> str:
    """Remove the launcher's ``[rank R] `` line prefixes from ``text``."""
    return "\n".join(_RANK_PREFIX.sub("", line, count=1) for line in text.splitlines())


def parse_tables(text: str) -> list[Table]:
    """Read back the tables printed by :class:`Report`.

    A table is a run of ``#`` lines (title, comments, column header) followed by rows; ``#``
    lines right after rows are notes of that table; a blank line ends a table. Lines that are
    not comments and come before any table header are ignored. Numbers become int or float,
    ``-`` becomes None. Raises ValueError when a row's field count differs from the header's.
    """
    tables: list[Table] = []
    pending: list[str] = []
    current: Table | None = None
    for raw in text.splitlines():
        line = _RANK_PREFIX.sub("", raw, count=1).strip()
        if not line:
            current, pending = None, []
            continue
        if line.startswith("#"):
            body = line[1:].strip()
            if current is not None:
                current.comments.append(body)
            else:
                pending.append(body)
            continue
        if current is None:
            if len(pending) < 2:
                pending = []
                continue
            columns = re.split(r"\s{2,}", pending[-1])
            current = Table(pending[0], pending[1:-1], columns)
            tables.append(current)
            pending = []
        fields = line.split()
        if len(fields) != len(current.columns):
            raise ValueError(f"row {line!r} has {len(fields)} fields, header has "
                             f"{len(current.columns)} columns {current.columns}")
        current.rows.append({c: _cell(v) for c, v in zip(current.columns, fields, strict=True)})
    return tables


# --------------------------------------------------------------------------------- the main


def run_tool(open_rt: Callable[[], R], body: Callable[[R], None]) -> int:
    """Open the runtime, run ``body(rt)``, close the runtime; return the exit status.

    A :class:`CheckError` (raised on every rank together) is printed by rank 0 and gives 1.
    Any other error is printed with its traceback by the failing rank, which then aborts the
    process group (so its peers fail promptly instead of waiting) and returns 1.
    """
    try:
        rt = open_rt()
    except Exception:
        traceback.print_exc()
        return 1
    try:
        body(rt)
    except CheckError as exc:
        if rt.rank == 0:
            print(f"error: {exc}", file=sys.stderr, flush=True)
        rt.close()
        return 1
    except BaseException as exc:
        traceback.print_exc()
        rt.abort(f"{type(exc).__name__}: {exc}")
        rt.close()
        return 1
    rt.close()
    return 0


def tool_main(parser: argparse.ArgumentParser, argv: Sequence[str] | None,
              open_rt: Callable[[argparse.Namespace], R],
              run: Callable[[argparse.Namespace, R], None],
              validate: Callable[[argparse.ArgumentParser, argparse.Namespace], None] | None
              = None) -> int:
    """The ``main`` of every OSU-style tool: parse ``argv`` (None: ``sys.argv[1:]``) with
    ``parser``, exit with status 2 when the iteration options are inconsistent or
    ``validate(parser, args)`` rejects them (it calls ``parser.error``), then
    :func:`run_tool` with ``open_rt(args)`` and ``run(args, rt)``; return the exit status."""
    args = parser.parse_args(argv)
    try:
        schedule_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    if validate is not None:
        validate(parser, args)
    return run_tool(lambda: open_rt(args), lambda rt: run(args, rt))
