"""The MPI transport: bitcoll frames over non-blocking mpi4py point-to-point messages.

This is the only module of bitcoll that imports :mod:`mpi4py`, and it does so lazily (inside
:meth:`MPITransport.create` and the helpers it calls), so ``import bitcoll`` never initializes
MPI. Everything on the data path uses mpi4py's upper-case buffer methods (``Isend``/``Irecv``
on byte buffers); nothing is pickled.

Wire format
-----------
All bitcoll traffic runs on a private duplicate of the user's communicator, so it can never
match the user's own messages. Two tags are used on it:

* :data:`DATA_TAG` carries frames. A frame whose payload has at most :data:`INLINE_MAX` bytes
  is **one** MPI message: the 32-byte header followed by the payload (the payload is copied
  into a small staging buffer; a copy of a few KiB costs less than a second message). A larger
  frame is **two** consecutive MPI messages on the same tag: the 32-byte header, then the
  payload straight from (and into) the caller's buffer, with no copy. MPI's non-overtaking rule
  (messages between one pair of ranks on one communicator and tag are matched in the order they
  were sent and posted) gives the transport contract's ordering: frames to one peer are
  delivered in ``isend`` order and matched to receives in posting order. The transport lock
  keeps the two messages of a frame adjacent when several threads post frames.
* :data:`CONTROL_TAG` carries abort notices (:data:`CONTROL_SIZE` bytes: a header of kind
  :attr:`~bitcoll.transport.base.FrameKind.ABORT` then the UTF-8 reason). Every transport
  keeps one receive posted on it from ``MPI.ANY_SOURCE`` and every wait loop (and every
  ``isend``/``irecv``) tests it, so an abort anywhere fails every rank within a few
  milliseconds instead of at its deadline.

A receive always posts the header message into a staging buffer of
``HEADER_SIZE + INLINE_MAX`` bytes (and, for a large frame, the payload message into the
caller's buffer at the same time). The received header is compared with the expected one before
the payload is used; a mismatch, a frame whose size disagrees with its header, or an MPI
truncation error (a peer sent more bytes than were posted) becomes
:class:`~bitcoll.errors.ProtocolError` and aborts the transport.

Traffic counters
----------------
:attr:`MPITransport.stats` counts *frames*: one message and ``HEADER_SIZE + payload length``
bytes per frame, which is exactly the number of bytes handed to MPI for it whether it travels as
one MPI message or two. A send is counted when it is handed to MPI (in ``isend``), a receive when
it completes successfully. Abort notices and native collectives are not counted.

Waiting
-------
:meth:`Request.wait` polls (``MPI_Test``) rather than blocking in ``MPI_Wait``, because only a
polling loop can honour a deadline and notice an abort. The loop spins for
:data:`SPIN_SECONDS` (small messages complete in tens of microseconds on an idle machine), then
calls ``sched_yield`` between tests until :data:`YIELD_SECONDS` have passed, then sleeps
:data:`MIN_SLEEP_SECONDS` between tests until :data:`SHORT_SLEEP_SECONDS` have passed (MPI's
collectives progress on a rank only while it tests them), then for exponentially growing
intervals up to :data:`MAX_SLEEP_SECONDS`, so a long wait costs a fraction of a percent of a
core. When :meth:`MPITransport.create` finds
more ranks of the communicator on this node than CPUs this process may run on (an
oversubscribed node), spinning only steals the CPU from the rank being waited for: the loop
then spins for :data:`OVERSUBSCRIBED_SPIN_SECONDS` only and calls ``sched_yield`` between tests
until :data:`SHORT_SLEEP_SECONDS`, as MPICH's own progress loop does (measured, 4 ranks on 2
cores, 8-byte all-reduce: 4.8 ms with growing sleeps from the start, 0.8 ms with short
sleeps, 0.5 ms with yields), then sleeps with growing pauses.

Streams
-------
:meth:`MPITransport.stream` runs a whole ring pass (a
:class:`~bitcoll.transport.base.StreamPlan`: the frames one rank sends right and receives from
the left, which received ones are folded, landed or forwarded) in one loop on the calling
thread: the same MPI messages as the equivalent ``isend``/``irecv`` calls, so a streaming rank
and one making its frames one by one work together, but with no request object and no wait loop
per frame. Sends are posted in plan order as soon as they may leave (a forward once its receive
is folded); receives are posted in order, :data:`STREAM_WINDOW` ahead, a folded one into one of
two landing buffers the transport keeps, a landed one straight into the array; the loop tests
the oldest receive, checks its header as ``irecv`` does and folds with numpy outside the lock
(the frame path's reduce_into, so every dtype and op streams), and every :data:`STREAM_IDLE_TESTS`
unsuccessful tests (every test on an oversubscribed node) it polls the abort channel, checks
the deadline and backs off like a wait loop. Any error, a timeout included, fails the
transport: a stream half done cannot be resumed (its receives are cancelled, whatever MPI may
still touch is kept alive). Measured (2 ranks, float32): streamed, bitcoll's ring is faster
than MPICH's all-reduce from 1 MiB (README, "Over MPI").

Native collectives
------------------
MPI's own collectives (``native_allreduce`` etc.) are exposed as methods of this transport so
that algorithm code can use them without importing mpi4py. They use the non-blocking MPI
collectives polled with the same deadline and abort logic as frames. MPI cannot cancel a
collective: after one failed or timed out it stays pending inside MPI, so the transport must
then be aborted (as the communicator does after any CommError) and its communicator is not
freed. Reductions take the MPI datatypes of an explicit table (see
:meth:`MPITransport._reduce_type`), not ``mpi4py.util.dtlib.from_numpy_dtype``: that function
returns a new duplicate of the predefined type on every call (to be freed by the caller), maps
int8/int64 to ``MPI_SIGNED_CHAR``/``MPI_LONG`` instead of the fixed-width types, and maps
float16, bool and long double to types (``MPIX_C_FLOAT16``, ``MPI_C_BOOL``,
``MPI_LONG_DOUBLE``) that MPI either cannot reduce portably or reduces only with logical
operations; those dtypes must keep failing with UsageError before anything is sent, so that
the communicator falls back to its own algorithms.

Argument records
----------------
Every collective over MPI starts with :meth:`MPITransport.exchange_records`: one MPI
all-gather of a fixed-size record per rank (:func:`record_bytes` bytes: a 16-byte header of
sequence number and call signature, then up to ``record_bytes - 16`` bytes of payload). Its
size never varies, so it cannot mismatch itself, whatever the ranks called; every rank sees
every rank's header and so finds the same disagreement (the communicator's argument check).
The payload lets a small collective travel inside the check: a small all-reduce is the
exchange plus a local reduction, one MPI collective in all. The all-gather is a persistent
collective (``MPI_Allgather_init``, started once per call: about half the cost of a fresh
``MPI_Iallgather`` for a few hundred bytes) where the MPI library has them, else
``MPI_Iallgather``. Like every native collective, it is tested
:data:`COLLECTIVE_SPIN_TESTS` times without the wait loop's bookkeeping, then waited for in
the wait loop.

Sub-communicators
-----------------
:meth:`MPITransport.split` is ``MPI_Comm_split`` on the private communicator, collective over
it; every rank gets a transport over the ranks of its colour (or None), with its own private
communicator, abort channel, counters and lock, the parent's timeout and ``oversubscribed``
flag. MPI has no non-blocking split, so the split is preceded by a non-blocking barrier
polled like a native collective (deadline: the parent's ``timeout``; an abort fails it): a
rank that never calls ``split`` makes the others raise CommTimeoutError instead of hanging.
Once that barrier completed on a rank, the blocking ``MPI_Comm_split`` follows at once, and
every rank has entered the split, so it is bounded by MPI only. :meth:`MPITransport.create`
takes any mpi4py intra-communicator (``MPI.COMM_WORLD``, a user's ``Split``, ...).

Threads: each transport serializes its MPI calls with its own lock, so under MPI's
``THREAD_MULTIPLE`` level (mpi4py's default) several transports (a parent and its
sub-transports) can be used from several threads at once. When MPI was initialized with a
lower thread level, every transport shares one lock, so MPI is never entered by two threads
at the same time.

Failures at exit
----------------
An MPI job only ends when every rank ends, and ``MPI_Finalize`` (run by mpi4py after the
interpreter's ``atexit`` handlers) waits for every rank of the job. Two rules keep a failed
job from hanging:

1. **An uncaught exception ends the whole job.** The first transport created installs (once,
   chaining to the hook it found) a :data:`sys.excepthook` that prints the traceback as usual
   (through the previous hook), sends an abort notice with the exception's text to the peers
   of every open transport (they raise ``PeerLostError("rank r aborted: uncaught
   ValueError: ...")`` if they look before they are killed), flushes ``sys.stdout`` and
   ``sys.stderr``, and calls ``MPI.COMM_WORLD.Abort(1)`` (130 for ``KeyboardInterrupt``):
   mpiexec then kills every rank and exits non-zero within a second or so. When the uncaught
   exception is a :class:`~bitcoll.errors.PeerLostError` (this rank only saw another rank
   fail), the abort waits :data:`SECONDARY_ABORT_GRACE_SECONDS` first, so that the rank where
   the failure started prints its own traceback before mpiexec kills it (otherwise it waits
   :data:`OUTPUT_FORWARD_SECONDS`, for mpiexec to forward what was flushed). Like any
   ``MPI_Abort`` this skips the failed rank's ``atexit`` handlers. The hook does nothing more
   than the previous hook when the world has one process, in an interactive session (``python
   -i``, a REPL), or when MPI is not initialized or already finalized. ``SystemExit``
   (``sys.exit(n)``) is not an uncaught exception and exits normally. Exceptions in other
   threads (:data:`threading.excepthook`) are left alone: they end that thread, not the
   process, and the main thread may still finish normally.
2. **A timeout bounds MPI_Finalize.** A transport *records a finalize risk* when one of its
   operations raised CommTimeoutError (a frame, a native collective, :meth:`create`, the
   barrier of :meth:`split`: some peer did not answer before a deadline, so it may be stopped
   or hung), or when MPI itself reported an error on a send, receive or collective (a
   truncation, i.e. a protocol mismatch between live ranks, does not count). Aborts, protocol
   errors and usage errors do not count: the peer that sent the abort notice or the
   mismatched frame is alive. At interpreter exit (an ``atexit`` handler, which first closes
   the open transports), if this process recorded a finalize risk (open or closed transports
   alike) and MPI is initialized and not finalized, the handler prints one line to stderr and
   arms a real-time timer of :func:`finalize_grace` seconds (default
   :data:`FINALIZE_GRACE_SECONDS`, environment variable ``BITCOLL_MPI_FINALIZE_GRACE``;
   ``inf`` disables the bound) with ``SIGALRM`` at its default action. ``MPI_Finalize`` then
   runs as usual: when every rank reaches it (a failure the program handled, every rank
   alive: e.g. the deliberate timeouts of the test suite), it returns at once and the
   process exits with its normal status. When it has not returned at the end of the grace
   period (a peer is stopped, hung or still busy), the kernel kills the process with
   ``SIGALRM``, and mpiexec kills every other rank of the job (a stopped one included) and
   exits non-zero. Without a recorded risk, ``MPI_Finalize`` is never bounded: ranks that
   finish at different times wait for each other as in any MPI program. The handler is
   registered when this module is imported (by ``bitcoll.init``), so the grace period also
   covers the ``atexit`` handlers registered before that import, which run after it.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import importlib.util
import math
import os
import signal
import stat
import struct
import sys
import threading
import time
import zlib
from abc import abstractmethod
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final, cast

import numpy as np
import numpy.typing as npt

from ..config import DEFAULT_TIMEOUT
from ..errors import CommError, CommTimeoutError, PeerLostError, ProtocolError, UsageError
from ..kernels.stream import MODE_FOLD_DIVIDE, MODE_LAND
from ..ops import ReduceOp, reduce_into
from ..topology import usable_cores
from .base import (
    HEADER_SIZE,
    FrameHeader,
    FrameKind,
    NativeCollectives,
    Request,
    StreamPlan,
    TrafficStats,
    Transport,
    byte_view,
)
from .netio import Backoff
from .peer import OVERSUBSCRIBED_SPIN_SECONDS as OVERSUBSCRIBED_SPIN_SECONDS
from .peer import SPIN_SECONDS as SPIN_SECONDS

if TYPE_CHECKING:
    from mpi4py import MPI

__all__ = [
    "MPITransport",
    "launched_by_mpi",
    "mpi_available",
    "DATA_TAG",
    "CONTROL_TAG",
    "INLINE_MAX",
    "CONTROL_SIZE",
    "FINALIZE_GRACE_SECONDS",
    "FINALIZE_GRACE_ENV",
    "finalize_grace",
]

DATA_TAG: Final = 1
"""MPI tag of frame messages on the transport's private communicator."""

CONTROL_TAG: Final = 2
"""MPI tag of abort notices on the transport's private communicator."""

INLINE_MAX: Final = 8192
"""Largest payload (bytes) that travels in the same MPI message as its header."""

CONTROL_SIZE: Final = 512
"""Size in bytes of an abort notice: a 32-byte header and up to 480 bytes of UTF-8 reason."""

# SPIN_SECONDS: wait loops poll without pausing for this long (transport.peer's) ...

YIELD_SECONDS: Final = 300e-6
"""... then poll with ``sched_yield`` between tests until this much time has passed ..."""

MIN_SLEEP_SECONDS: Final = 20e-6
"""... then sleep between tests, doubling the pause from MIN_SLEEP_SECONDS ..."""

MAX_SLEEP_SECONDS: Final = 1e-3
"""... up to MAX_SLEEP_SECONDS."""

SHORT_SLEEP_SECONDS: Final = 20e-3
"""The pauses stay at MIN_SLEEP_SECONDS until a wait has lasted this long: MPI's collectives
advance on a rank only while it tests them, so on a node with more ranks than cores a
collective of several internal steps would lose up to a whole pause per step to a rank
that sleeps long (measured: 4 ranks on 2 cores, an 8-byte all-reduce took 4.8 ms with the
pauses growing at once)."""

# OVERSUBSCRIBED_SPIN_SECONDS (transport.peer's): the spin time when more ranks than CPUs
# share the node (then ``sched_yield`` between tests until SHORT_SLEEP_SECONDS).

RECORD_HEADER_BYTES: Final = 16
"""Bytes of a record's header: the sequence number and the signature, two int64 (little
endian)."""

RECORD_MAX_BYTES: Final = 512
"""Largest record (see :func:`record_bytes`)."""

RECORD_MIN_BYTES: Final = 32
"""Smallest record: the header and 16 bytes of payload."""

RECORD_GATHER_BYTES: Final = 8192
"""Records shrink with the number of ranks so that an exchange gathers at most this many bytes
per rank (until they reach :data:`RECORD_MIN_BYTES`)."""

COLLECTIVE_SPIN_TESTS: Final = 64
"""Plain tests of a native collective (the record exchange included) before it is handed to
the general wait loop: a few tens of microseconds, within which a small collective between
ranks that arrive together completes (measured, 2 ranks, 64 KiB all-reduce: 30 us with these
tests, 47 us through the wait loop alone)."""

OVERSUBSCRIBED_SPIN_TESTS: Final = 4
"""The same with more ranks than CPUs on the node: spinning would steal the CPU from the rank
being waited for (the wait loop yields instead)."""

_RECORD_HEADER: Final = struct.Struct("<qq")
_RECORDS: Final = "argument check (record all-gather)"

CLOSE_DRAIN_SECONDS: Final = 0.2
"""How long :meth:`MPITransport.close` waits for outstanding MPI requests to finish."""

_REDUCE_OPS: Final = ("sum", "max", "min")


def record_bytes(size: int) -> int:
    """Bytes of one rank's record in :meth:`MPITransport.exchange_records` on ``size`` ranks:
    :data:`RECORD_GATHER_BYTES` / ``size`` rounded down to a multiple of 16, within
    [:data:`RECORD_MIN_BYTES`, :data:`RECORD_MAX_BYTES`] (512 up to 16 ranks, 128 on 64,
    32 from 256)."""
    return max(RECORD_MIN_BYTES, min(RECORD_MAX_BYTES, RECORD_GATHER_BYTES // max(1, size)
                                     // 16 * 16))

# MPI requests (with the buffers mpi4py keeps alive through them) and communicators that could
# not be completed or freed. Keeping them referenced forever is deliberate: MPI may still write
# into a receive buffer whose request could not be cancelled, so the memory must never be freed.
_LEAKED: list[object] = []

# Open transports, strongly referenced: an unclosed transport keeps a receive posted into its
# control buffer, so it must not be garbage-collected before close() (run at exit at the latest).
_LIVE: set[MPITransport] = set()


OUTPUT_FORWARD_SECONDS: Final = 0.2
"""How long the uncaught-exception hook waits between flushing its output and MPI_Abort."""

SECONDARY_ABORT_GRACE_SECONDS: Final = 1.0
"""How long an uncaught PeerLostError waits before MPI_Abort (module docstring, rule 1)."""

FINALIZE_GRACE_SECONDS: Final = 10.0
"""Default time ``MPI_Finalize`` gets after a recorded finalize risk (module docstring)."""

FINALIZE_GRACE_ENV: Final = "BITCOLL_MPI_FINALIZE_GRACE"
"""Environment variable overriding :data:`FINALIZE_GRACE_SECONDS` (``inf``: no bound)."""

# Why MPI_Finalize may hang in this process (module docstring, "Failures at exit"): one line per
# recorded risk, the first one is printed at exit.
_FINALIZE_RISKS: list[str] = []

# All transports share this lock when MPI runs below THREAD_MULTIPLE.
_SERIAL_LOCK = threading.RLock()

_HOOK_LOCK = threading.Lock()
_hook_installed = False
_previous_excepthook: Callable[[type[BaseException], BaseException, TracebackType | None],
                               Any] | None = None


def finalize_grace() -> float:
    """Seconds ``MPI_Finalize`` gets at exit after a recorded finalize risk.

    :data:`FINALIZE_GRACE_SECONDS` unless the environment variable ``BITCOLL_MPI_FINALIZE_GRACE``
    holds a positive number of seconds (``inf`` disables the bound; anything else is ignored).
    """
    text = os.environ.get(FINALIZE_GRACE_ENV, "").strip()
    if text:
        try:
            value = float(text)
        except ValueError:
            return FINALIZE_GRACE_SECONDS
        if value > 0:  # also False for NaN
            return value
    return FINALIZE_GRACE_SECONDS


def _note_finalize_risk(reason: str) -> None:
    _FINALIZE_RISKS.append(reason)


def _mpi_if_running() -> Any | None:
    """``mpi4py.MPI`` when this process imported it and MPI is initialized and not finalized;
    never imports it."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None:
        return None
    try:
        if not mpi.Is_initialized() or mpi.Is_finalized():
            return None
    except Exception:  # pragma: no cover - defensive
        return None
    return mpi


def _bound_finalize() -> None:
    """Rule 2 of the module docstring: arm the SIGALRM timer when a risk was recorded."""
    if not _FINALIZE_RISKS:
        return
    mpi = _mpi_if_running()
    if mpi is None:
        return
    grace = finalize_grace()
    if not math.isfinite(grace):
        return
    rank = mpi.COMM_WORLD.Get_rank()
    with contextlib.suppress(Exception):
        print(f"bitcoll: rank {rank}: {_FINALIZE_RISKS[0]}; MPI_Finalize gets {grace:g} s, "
              "then this process is killed (SIGALRM) in case a peer is stopped or hung "
              f"({FINALIZE_GRACE_ENV})", file=sys.stderr, flush=True)
    try:
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.setitimer(signal.ITIMER_REAL, grace)
    except (ValueError, OSError):  # pragma: no cover - not the main thread / no timer
        pass


def _at_exit() -> None:
    for transport in list(_LIVE):
        transport.close()
    _bound_finalize()


# Registered at import, i.e. before mpi4py is imported by create(); atexit runs handlers in
# reverse order, and mpi4py finalizes MPI after all of them (Py_AtExit), so the timer armed here
# covers MPI_Finalize.
atexit.register(_at_exit)


def _install_excepthook() -> None:
    """Rule 1 of the module docstring: install :func:`_excepthook` once."""
    global _hook_installed, _previous_excepthook
    with _HOOK_LOCK:
        if _hook_installed:
            return
        _hook_installed = True
        _previous_excepthook = sys.excepthook
        sys.excepthook = _excepthook


def _interactive() -> bool:
    return bool(sys.flags.interactive) or hasattr(sys, "ps1")


def _abort_world(code: int) -> None:
    """``MPI.COMM_WORLD.Abort(code)`` (a seam for the tests)."""
    mpi = sys.modules["mpi4py.MPI"]
    mpi.COMM_WORLD.Abort(code)


def _excepthook(exc_type: type[BaseException], exc: BaseException,
                tb: TracebackType | None) -> None:
    """Print the traceback (previous hook), tell every peer, end the MPI job."""
    previous = _previous_excepthook if _previous_excepthook is not None else sys.__excepthook__
    try:
        previous(exc_type, exc, tb)
    finally:
        _end_job_after_uncaught(exc_type, exc)


def _end_job_after_uncaught(exc_type: type[BaseException], exc: BaseException) -> None:
    mpi = _mpi_if_running()
    if mpi is None or _interactive():
        return
    code = 130 if issubclass(exc_type, KeyboardInterrupt) else 1
    try:
        world = mpi.COMM_WORLD
        if world.Get_size() == 1:
            return
        reason = f"uncaught {exc_type.__name__}: {exc}"
        for transport in list(_LIVE):
            transport._abort_nowait(reason)
        print(f"bitcoll: rank {world.Get_rank()}: uncaught {exc_type.__name__}, aborting the "
              f"MPI job (MPI_Abort({code}))", file=sys.stderr)
    except Exception:  # pragma: no cover - nothing may stop the abort
        pass
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    # mpiexec forwards a rank's output through its proxy, and MPI_Abort can overtake what was
    # just flushed: give it a moment. Another rank failed first (PeerLostError): let that rank
    # print its traceback and abort the job itself.
    time.sleep(SECONDARY_ABORT_GRACE_SECONDS if issubclass(exc_type, PeerLostError)
               else OUTPUT_FORWARD_SECONDS)
    _abort_world(code)


# --------------------------------------------------------------------------------------------
# Environment detection
# --------------------------------------------------------------------------------------------


def _is_open_socket(fd_text: str) -> bool:
    try:
        fd = int(fd_text)
        return stat.S_ISSOCK(os.fstat(fd).st_mode)
    except (ValueError, OSError):
        return False


def launched_by_mpi() -> bool:
    """Return True when this process was started by an MPI launcher (``mpiexec``/``srun``).

    Only environment variables are inspected (and one ``fstat``); mpi4py is not imported. The
    process counts as MPI-launched when any of these holds:

    * **Open MPI** (``mpirun``/``prterun``): ``OMPI_COMM_WORLD_SIZE`` is set. Open MPI's
      launcher sets it (with ``OMPI_COMM_WORLD_RANK``) in every process it starts.
    * **PMIx** (Open MPI 5 / PRRTE, ``srun --mpi=pmix``, any PMIx server): ``PMIX_RANK`` is set.
      A PMIx server sets it for every client process it launches.
    * **PMI-1 / PMI-2** (MPICH's Hydra ``mpiexec``, Intel MPI and MVAPICH under Hydra,
      ``srun --mpi=pmi2``): ``PMI_RANK`` is set *and* the PMI connection it relies on exists:
      ``PMI_FD`` names a socket that is open in this process, or ``PMI_PORT`` (a
      ``host:port`` the client connects to) is set. Hydra also sets ``PMI_SIZE``,
      ``MPI_LOCALNRANKS`` and ``HYDI_CONTROL_FD``, which add nothing to this test.

    The ``PMI_FD`` check matters because environment variables are inherited: a child process
    started by an MPI rank (for example with :mod:`subprocess`, which closes inherited file
    descriptors by default) sees the rank's ``PMI_*`` variables but not its PMI socket, and an
    MPI initialization there would fail. Such a child is correctly reported as not launched by
    MPI. The same cannot be checked cheaply for Open MPI and PMIx (their variables point to a
    server address, not to a descriptor), so a child of an Open MPI rank that keeps the parent's
    environment is reported as MPI-launched.

    Slurm sets ``SLURM_PROCID`` in every task of a step, including steps that are not MPI jobs
    (``srun -n 4 python x.py`` runs four independent processes). It is therefore not sufficient
    on its own: a Slurm step counts as MPI only through the PMI-2 or PMIx variables that
    Slurm's ``--mpi`` plugins set, which the rules above already cover.
    """
    env = os.environ
    if "OMPI_COMM_WORLD_SIZE" in env or "PMIX_RANK" in env:
        return True
    if "PMI_RANK" in env:
        if "PMI_PORT" in env:
            return True
        fd_text = env.get("PMI_FD")
        if fd_text is not None and _is_open_socket(fd_text):
            return True
    return False


def mpi_available() -> bool:
    """Return True when mpi4py is installed with its compiled ``mpi4py.MPI`` module.

    This finds the module without importing it (importing ``mpi4py.MPI`` initializes MPI), so
    it does not prove that the MPI library itself loads; :meth:`MPITransport.create` does.
    """
    try:
        return importlib.util.find_spec("mpi4py.MPI") is not None
    except (ImportError, ValueError):
        return False


def _mpi() -> Any:
    """Import and return ``mpi4py.MPI`` (initializes MPI on first use)."""
    try:
        from mpi4py import MPI as mpi_module
    except ImportError as exc:  # pragma: no cover - depends on the installation
        raise UsageError("the MPI transport needs mpi4py: pip install 'bitcoll[mpi]'") from exc
    return mpi_module


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def _mpi_error_class(exc: BaseException) -> int | None:
    get = getattr(exc, "Get_error_class", None)
    if get is None:
        return None
    try:
        return int(get())
    except Exception:  # pragma: no cover - defensive
        return None


def _frame_problem(first: memoryview, count: int, expected: FrameHeader,
                   expected_bytes: bytes, peer: int) -> str | None:
    """What is wrong with the first MPI message of a frame from ``peer``: ``count`` bytes
    arrived, ``first`` is the staging buffer they landed in. Checked against the
    ``expected`` header (``expected_bytes``: packed): a header (and the payload of an inline
    frame, at most :data:`INLINE_MAX` bytes) of exactly the expected size. None when it is
    the expected frame."""
    if count < HEADER_SIZE:
        return f"rank {peer} sent a {count}-byte message where a frame header was expected"
    received = first[:HEADER_SIZE]
    if received != expected_bytes:  # fast path: byte-wise equal headers
        try:
            got = FrameHeader.unpack(received)
        except ProtocolError as exc:  # bad magic or version
            return f"from rank {peer}: {exc}"
        problem = got.mismatch(expected, peer)
        if problem is not None:
            return problem
    n = expected.length
    if n <= INLINE_MAX:
        if count != HEADER_SIZE + n:
            return (f"rank {peer} sent a frame of {count - HEADER_SIZE} payload bytes whose "
                    f"header announces {n}")
    elif count != HEADER_SIZE:
        return (f"rank {peer} sent {count - HEADER_SIZE} payload bytes inline for a frame of "
                f"{n} bytes (peers disagree on the inline limit)")
    return None


def _payload_problem(count: int, n: int, peer: int) -> str:
    """The error message of a two-message frame from ``peer`` whose payload message has
    ``count`` bytes where its header announced ``n``."""
    return f"rank {peer} sent {count} payload bytes for a frame whose header announces {n}"


def _receive_failed(t: MPITransport, exc: BaseException, peer: int, posted: int,
                    expected: FrameHeader) -> ProtocolError:
    """The ProtocolError of a receive from ``peer`` that MPI failed with ``exc`` (``posted``
    bytes were posted for the message): a truncation names the mismatched lengths, anything
    else is also recorded as a finalize risk. The caller fails the transport with it."""
    if _mpi_error_class(exc) == t._mpi.ERR_TRUNCATE:
        err = ProtocolError(
            f"rank {peer} sent a message longer than the {posted} bytes posted for it "
            f"(collective #{expected.seq}, step {expected.step}): mismatched lengths across "
            "ranks", peer=peer, sequence=expected.seq)
    else:
        t._note_risk(f"MPI failed to receive from rank {peer}: {exc}")
        err = ProtocolError(f"MPI failed to receive from rank {peer}: {exc}", peer=peer,
                            sequence=expected.seq)
    err.__cause__ = exc
    return err


class _Poller:
    """Back-off state of one wait loop: spin, then yield, then sleep with growing pauses."""

    __slots__ = ("_backoff", "_spin", "_start", "_yield")

    def __init__(self, oversubscribed: bool = False) -> None:
        self._start = time.monotonic()
        self._backoff = Backoff(MIN_SLEEP_SECONDS, MAX_SLEEP_SECONDS)
        if oversubscribed:
            self._spin, self._yield = OVERSUBSCRIBED_SPIN_SECONDS, SHORT_SLEEP_SECONDS
        else:
            self._spin, self._yield = SPIN_SECONDS, YIELD_SECONDS

    def pause(self, now: float) -> None:
        """Called after an unsuccessful test at time ``now``: wait a little, or not."""
        elapsed = now - self._start
        if elapsed < self._spin:
            return
        if elapsed < self._yield:
            os.sched_yield()
            return
        if elapsed < SHORT_SLEEP_SECONDS:
            time.sleep(MIN_SLEEP_SECONDS)
            return
        time.sleep(self._backoff.next())


_REDUCE_TABLES: dict[str, dict[str, Any]] = {}
_REDUCE_CACHE: dict[tuple[np.dtype[Any], str], tuple[Any, Any]] = {}
_EXTREMES_LANES: Final = 16
"""Values per rank in the fixed-size message of :meth:`MPITransport.native_extremes`."""
"""(dtype, op) -> (MPI datatype, MPI op), filled by :meth:`MPITransport._reduce_type`."""


def _reduce_table(mpi: Any, op: str) -> dict[str, Any]:
    """numpy dtype name -> predefined MPI datatype that MPI reduces with ``op`` (built once;
    types this MPI library lacks are left out)."""
    table = _REDUCE_TABLES.get(op)
    if table is None:
        names = {
            "int8": "INT8_T", "int16": "INT16_T", "int32": "INT32_T", "int64": "INT64_T",
            "uint8": "UINT8_T", "uint16": "UINT16_T", "uint32": "UINT32_T",
            "uint64": "UINT64_T", "float32": "FLOAT", "float64": "DOUBLE",
        }
        if op == "sum":  # MPI defines MAX and MIN on real types only
            names.update(complex64="C_FLOAT_COMPLEX", complex128="C_DOUBLE_COMPLEX")
        table = {}
        for dtype, name in names.items():
            mpitype = getattr(mpi, name, None)
            if mpitype is not None and mpitype != mpi.DATATYPE_NULL:
                table[dtype] = mpitype
        _REDUCE_TABLES[op] = table
    return table


# --------------------------------------------------------------------------------------------
# Requests
# --------------------------------------------------------------------------------------------


class _MPIRequest(Request):
    """Base of the transport's requests: progress under the lock, poll with back-off.

    Subclasses implement :meth:`_progress` and :meth:`_describe` (and :meth:`_cancel` when
    MPI can cancel what they posted)."""

    def __init__(self, transport: MPITransport, mpi_requests: list[MPI.Request],
                 keep: tuple[object, ...]) -> None:
        self._t = transport
        self._reqs = mpi_requests
        self._keep = keep  # buffers that must stay alive while MPI may touch them
        self._complete = False
        self._error: CommError | None = None
        self._posted = time.monotonic()

    @abstractmethod
    def _progress(self) -> bool:
        """Test the MPI requests (transport lock held): True when complete, CommError when
        this request failed."""

    @abstractmethod
    def _describe(self) -> str:
        """What this request is, for error messages."""

    def _step(self) -> bool:
        """One non-blocking progress step: True if complete; raises CommError on failure."""
        t = self._t
        with t._lock:
            if self._complete:
                return True
            if self._error is not None:
                raise self._error.with_traceback(None)
            if t._failure is None:
                # Progress first: a frame that already arrived completes even if an abort
                # notice arrived just after it.
                try:
                    done = self._progress()
                except CommError as exc:
                    self._error = exc
                    raise
                if done:
                    self._complete = True
                    t._pending.discard(self)
                    return True
            failure = t._check_failure()
            if failure is not None:
                self._error = failure
                raise failure.with_traceback(None)
            return False

    def done(self) -> bool:
        try:
            return self._step()
        except CommError:
            return True

    def wait(self, deadline: float) -> None:
        if self._step():
            return
        poller = _Poller(self._t.oversubscribed)
        while not self._step():
            now = time.monotonic()
            if now > deadline:
                if self._step():  # a last look before giving up
                    return
                waited = now - self._posted
                peer, sequence = self._context()
                err = CommTimeoutError(
                    f"{self._describe()} did not complete before the deadline "
                    f"({waited:.3g} s after it was posted)", peer=peer, sequence=sequence)
                self._t._note_risk(f"a peer did not answer in time: {err}")
                raise err
            poller.pause(now)

    def _cancel(self) -> None:
        """Cancel what MPI allows to cancel (receives); called with the lock held."""

    def _context(self) -> tuple[int | None, int | None]:
        """The structured context of this request's errors: ``(peer, sequence)``, None where
        there is none (a native collective)."""
        return None, None


class _SendRequest(_MPIRequest):
    def __init__(self, transport: MPITransport, mpi_requests: list[MPI.Request],
                 keep: tuple[object, ...], peer: int, header: FrameHeader) -> None:
        super().__init__(transport, mpi_requests, keep)
        self._peer = peer
        self._header = header

    def _progress(self) -> bool:
        while self._reqs:
            try:
                if not self._reqs[0].Test():
                    return False
            except self._t._mpi.Exception as exc:
                err = CommError(f"MPI failed to send to rank {self._peer}: {exc}")
                self._t._note_risk(str(err))
                self._t._fail(err, notify=True)
                raise err from exc
            self._reqs.pop(0)
        return True

    def _describe(self) -> str:
        h = self._header
        return (f"send of {h.length} bytes to rank {self._peer} (collective #{h.seq}, "
                f"step {h.step})")

    def _context(self) -> tuple[int | None, int | None]:
        return self._peer, self._header.seq


class _RecvRequest(_MPIRequest):
    def __init__(self, transport: MPITransport, mpi_requests: list[MPI.Request],
                 keep: tuple[object, ...], peer: int, expected: FrameHeader,
                 staging: npt.NDArray[np.uint8], payload: memoryview) -> None:
        super().__init__(transport, mpi_requests, keep)
        self._peer = peer
        self._expected = expected
        self._expected_bytes = expected.pack()
        self._staging = staging
        self._payload = payload
        self._header_done = False
        self._status = transport._mpi.Status()

    def _protocol_error(self, message: str) -> ProtocolError:
        err = ProtocolError(message, peer=self._peer, sequence=self._expected.seq)
        self._t._fail(err, notify=True)
        return err

    def _test(self, index: int, status: MPI.Status, posted: int) -> bool:
        """Test one MPI request; MPI errors (truncation) become ProtocolError."""
        try:
            return bool(self._reqs[index].Test(status))
        except self._t._mpi.Exception as exc:
            err = _receive_failed(self._t, exc, self._peer, posted, self._expected)
            self._t._fail(err, notify=True)
            raise err from exc

    def _progress(self) -> bool:
        mpi = self._t._mpi
        status = self._status
        n = self._expected.length
        if not self._header_done:
            if not self._test(0, status, self._staging.nbytes):
                return False
            problem = _frame_problem(self._staging.data, status.Get_count(mpi.BYTE),
                                     self._expected, self._expected_bytes, self._peer)
            if problem is not None:
                raise self._protocol_error(problem)
            if 0 < n <= INLINE_MAX:
                self._payload[:] = self._staging.data[HEADER_SIZE:HEADER_SIZE + n]
            self._header_done = True
        if n > INLINE_MAX:
            if not self._test(1, status, n):
                return False
            count = status.Get_count(mpi.BYTE)
            if count != n:
                raise self._protocol_error(_payload_problem(count, n, self._peer))
        self._t.stats.add_received(HEADER_SIZE + n)
        self._reqs.clear()
        return True

    def _cancel(self) -> None:
        for req in self._reqs:
            with contextlib.suppress(self._t._mpi.Exception):  # already complete
                req.Cancel()

    def _describe(self) -> str:
        h = self._expected
        return (f"receive of {h.length} bytes from rank {self._peer} (collective #{h.seq}, "
                f"step {h.step})")

    def _context(self) -> tuple[int | None, int | None]:
        return self._peer, self._expected.seq


class _CollectiveRequest(_MPIRequest):
    def __init__(self, transport: MPITransport, mpi_request: MPI.Request,
                 keep: tuple[object, ...], what: str | Callable[[], str]) -> None:
        super().__init__(transport, [mpi_request], keep)
        self._what_text = what

    @property
    def _what(self) -> str:
        what = self._what_text
        return what if isinstance(what, str) else what()

    def _progress(self) -> bool:
        try:
            if not self._reqs[0].Test():
                return False
        except self._t._mpi.Exception as exc:
            raise self._t._collective_failed(self._what, exc) from exc
        self._reqs.clear()
        return True

    def _describe(self) -> str:
        return f"native {self._what}"


_STREAM_OPS: Final = frozenset(("sum", "max", "min"))
"""A stream plan's ops (an avg folds as a sum, then divides at the owner)."""

STREAM_WINDOW: Final = 2
"""Receives a stream keeps posted ahead (each folded one lands in its own reused buffer)."""

STREAM_IDLE_TESTS: Final = 16
"""Unsuccessful tests a stream makes between looks at the clock, the abort channel and the
back-off (:class:`_Poller`); one on an oversubscribed node, where spinning only keeps the
rank being waited for off the core."""


class _StreamRun:
    """One :meth:`MPITransport.stream`: the plan's frames as the same MPI messages ``isend``
    and ``irecv`` would post, driven by one loop on the calling thread.

    Sends are posted in plan order as soon as they may leave (a forward once its receive is
    folded or landed); receives are posted in plan order, at most :data:`STREAM_WINDOW`
    ahead of the oldest unfinished one, a folded one into a reused landing buffer of the
    transport's, a landed one straight into ``work``. The loop tests the oldest receive
    (header message, then payload message), checks the header as ``irecv`` does, and folds
    (``work = src op payload``, numpy) outside the transport lock. Every
    :data:`STREAM_IDLE_TESTS` unsuccessful tests it polls the abort channel, checks the
    deadline and backs off like a wait loop."""

    __slots__ = ("_done", "_head", "_keep", "_land", "_plan", "_posted", "_sends", "_sent",
                 "_src", "_staging", "_t", "_work", "in_peer", "out_peer")

    def __init__(self, t: MPITransport, out_peer: int, in_peer: int, plan: StreamPlan) -> None:
        self._t = t
        self.out_peer = out_peer
        self.in_peer = in_peer
        self._plan = plan
        self._work = plan.work.view(np.uint8)
        self._src = plan.src.view(np.uint8)
        self._sent = 0  # sends posted
        self._done = 0  # receives finished (folded or landed), in order
        # Posted receives, oldest first: [index, header request, payload request or None,
        # staging row, payload destination (bytes), header checked].
        self._posted: list[list[Any]] = []
        self._head = 0  # next receive to post
        self._sends: list[MPI.Request] = []  # unfinished sends
        self._keep: list[object] = []  # their header and inline frame buffers
        self._staging = np.empty((STREAM_WINDOW, HEADER_SIZE + INLINE_MAX), np.uint8)
        self._land: list[npt.NDArray[np.uint8]] = []

    def run(self, deadline: float) -> None:
        t = self._t
        lock = t._lock
        recvs = self._plan.recvs
        with lock:
            t._check_usable()
            self._land = t._take_stream_buffers()
        try:
            with lock:
                self._post()
            idle = 0
            # Between looks: a few tests, or one where ranks share cores (back off at once).
            every = 1 if t.oversubscribed else STREAM_IDLE_TESTS
            poller: _Poller | None = None
            while self._done < len(recvs) or self._sends or self._sent < len(self._plan.sends):
                with lock:
                    if t._failure is not None:
                        raise t._failure.with_traceback(None)
                    finished = self._test_receive() if self._posted else self._test_sends()
                if finished is not None:
                    if finished >= 0:
                        self._finish(finished)
                        with lock:
                            self._post()
                    idle = 0
                    poller = None
                    continue
                idle += 1
                if idle % every:
                    continue
                now = time.monotonic()
                with lock:
                    failure = t._check_failure()
                if failure is not None:
                    raise failure.with_traceback(None)
                if now > deadline:
                    raise self._timeout()
                if poller is None:
                    poller = _Poller(t.oversubscribed)
                poller.pause(now)
        except BaseException as exc:
            self._abandon(exc)
            raise
        with lock:
            t._give_stream_buffers(self._land)
        plan = self._plan
        t.stats.add_sent(sum(h.length for h, *_ in plan.sends) + HEADER_SIZE * len(plan.sends),
                         len(plan.sends))
        t.stats.add_received(sum(h.length for h, *_ in recvs) + HEADER_SIZE * len(recvs),
                             len(recvs))

    def _post(self) -> None:
        """Post every send that may leave now and the receives the window allows (lock
        held)."""
        t, mpi = self._t, self._t._mpi
        comm, byte = t._comm, mpi.BYTE
        sends, itemsize = self._plan.sends, self._plan.work.itemsize
        while self._sent < len(sends):
            header, start, stop, from_src, after = sends[self._sent]
            if after >= self._done:
                break
            payload = (self._src if from_src else self._work)[start * itemsize:stop * itemsize]
            n = payload.nbytes
            if n <= INLINE_MAX:
                frame = np.empty(HEADER_SIZE + n, np.uint8)
                header.pack_into(frame.data)
                frame[HEADER_SIZE:] = payload
                self._sends.append(comm.Isend([frame, byte], self.out_peer, DATA_TAG))
                self._keep.append(frame)
            else:
                head = header.pack()
                self._sends.append(comm.Isend([head, byte], self.out_peer, DATA_TAG))
                self._sends.append(comm.Isend([payload, byte], self.out_peer, DATA_TAG))
                self._keep.append(head)
            self._sent += 1
        recvs = self._plan.recvs
        while self._head < len(recvs) and self._head < self._done + STREAM_WINDOW:
            j = self._head
            header, start, stop, mode = recvs[j]
            n = header.length
            staging = self._staging[j % STREAM_WINDOW]
            first = comm.Irecv([staging, byte], self.in_peer, DATA_TAG)
            dst: npt.NDArray[np.uint8] | None = None
            rest = None
            if n > INLINE_MAX:
                if mode == MODE_LAND:
                    dst = self._work[start * itemsize:stop * itemsize]
                else:
                    dst = self._landing(j % STREAM_WINDOW, n)
                rest = comm.Irecv([dst, byte], self.in_peer, DATA_TAG)
            self._posted.append([j, first, rest, staging, dst, False])
            self._head = j + 1

    def _landing(self, k: int, n: int) -> npt.NDArray[np.uint8]:
        """Landing buffer ``k`` (of :data:`STREAM_WINDOW`), at least ``n`` bytes."""
        land = self._land
        while len(land) <= k:
            land.append(np.empty(0, np.uint8))
        if land[k].nbytes < n:
            land[k] = np.empty(n, np.uint8)
        return land[k][:n]

    def _test_receive(self) -> int | None:
        """Test the oldest posted receive (lock held): its index once both of its messages
        arrived and were checked, else None. ProtocolError for a frame that is not the
        expected one."""
        entry = self._posted[0]
        j: int = entry[0]
        first, rest, staging, _, checked = entry[1:]
        header = self._plan.recvs[j][0]
        t, mpi = self._t, self._t._mpi
        status = t._stream_status
        if not checked:
            try:
                if not first.Test(status):
                    return None
            except mpi.Exception as exc:
                raise _receive_failed(t, exc, self.in_peer, staging.nbytes, header) from exc
            problem = _frame_problem(staging.data, status.Get_count(mpi.BYTE), header,
                                     header.pack(), self.in_peer)
            if problem is not None:
                raise ProtocolError(problem, peer=self.in_peer, sequence=header.seq)
            entry[5] = True
        if rest is not None:
            try:
                if not rest.Test(status):
                    return None
            except mpi.Exception as exc:
                raise _receive_failed(t, exc, self.in_peer, header.length, header) from exc
            count = status.Get_count(mpi.BYTE)
            if count != header.length:
                raise ProtocolError(_payload_problem(count, header.length, self.in_peer),
                                    peer=self.in_peer, sequence=header.seq)
        return j

    def _test_sends(self) -> int | None:
        """Test the unfinished sends (lock held): -1 when all have finished, else None."""
        try:
            if not self._t._mpi.Request.Testall(self._sends):
                return None
        except self._t._mpi.Exception as exc:
            self._t._note_risk(f"MPI failed to send to rank {self.out_peer}: {exc}")
            raise CommError(f"MPI failed to send to rank {self.out_peer}: {exc}",
                            peer=self.out_peer) from exc
        self._sends = []
        return -1

    def _finish(self, j: int) -> None:
        """Fold or land receive ``j``, whose messages have arrived (outside the lock)."""
        entry = self._posted.pop(0)
        plan = self._plan
        header, start, stop, mode = plan.recvs[j]
        n = header.length
        inline = n <= INLINE_MAX
        payload = entry[3][HEADER_SIZE:HEADER_SIZE + n] if inline else entry[4]
        if mode == MODE_LAND:
            if inline:  # else it landed in work
                itemsize = plan.work.itemsize
                self._work[start * itemsize:stop * itemsize] = payload
        else:
            out = plan.work[start:stop]
            reduce_into(out, plan.src[start:stop], payload.view(plan.work.dtype),
                        ReduceOp(plan.op))
            if mode == MODE_FOLD_DIVIDE:
                np.divide(out, np.asarray(plan.divisor, dtype=out.dtype), out=out)
        self._done = j + 1

    def _timeout(self) -> CommTimeoutError:
        """The error of a stream past its deadline: the oldest receive it waits for, else its
        sends (``peer`` is that neighbour; over MPI no rank can tell whether it waits in
        turn for another, so ``silent`` stays unknown)."""
        plan = self._plan
        if self._posted:
            header = plan.recvs[self._posted[0][0]][0]
            what = (f"receive of {header.length} bytes from rank {self.in_peer} (collective "
                    f"#{header.seq}, step {header.step})")
            peer = self.in_peer
        else:
            header = plan.sends[-1][0]
            what, peer = f"send to rank {self.out_peer}", self.out_peer
        err = CommTimeoutError(f"stream: {what} did not complete before the deadline",
                               peer=peer, sequence=header.seq)
        self._t._note_risk(f"a peer did not answer in time: {err}")
        return err

    def _abandon(self, exc: BaseException) -> None:
        """After ``exc`` ended the stream: cancel its receives, keep whatever MPI may still
        touch alive until the communicator is released, and fail the transport (a stream
        half done cannot be resumed; peers are told)."""
        t = self._t
        with t._lock:
            keep: list[object] = [self._staging, self._land, self._plan.work, self._plan.src,
                                  self._keep]
            for entry in self._posted:
                for req in entry[1:3]:
                    if req is not None:
                        with contextlib.suppress(t._mpi.Exception):
                            req.Cancel()
                        t._orphans.append(req)
            t._orphans.extend(self._sends)
            self._posted, self._sends = [], []
            t._keep.append(keep)
            if isinstance(exc, CommError):
                t._fail(exc, notify=True)
            else:
                t._fail(CommError(f"a stream was interrupted by {exc!r}"), notify=True)


# --------------------------------------------------------------------------------------------
# The transport
# --------------------------------------------------------------------------------------------


class MPITransport(Transport):
    """Bitcoll frames over a private duplicate of an MPI communicator.

    Create it with :meth:`create` (collective over the communicator). ``rank`` and ``size`` are
    those of the communicator. ``timeout`` (seconds) is the default time budget of one
    operation for callers that do not compute their own deadlines (for example
    ``deadline = time.monotonic() + transport.timeout``); :meth:`create` itself uses it as its
    own deadline. ``oversubscribed`` (set by :meth:`create`, may be overridden) selects the
    wait loop's back-off (see the module docstring). Thread-safe: MPI calls are serialized by
    a lock (one per transport under ``THREAD_MULTIPLE``, one shared by every transport below
    it), so MPI's ``THREAD_SERIALIZED`` level is enough. :meth:`split` makes sub-transports.
    """

    name = "mpi"

    def __init__(self, comm: MPI.Intracomm, timeout: float, mpi_module: Any) -> None:
        """Internal: use :meth:`create`. ``comm`` must be a private duplicate."""
        self._mpi = mpi_module
        self._comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.timeout = float(timeout)
        self.oversubscribed = False
        self.stats = TrafficStats()
        multiple = mpi_module.Query_thread() >= mpi_module.THREAD_MULTIPLE
        self._lock = threading.RLock() if multiple else _SERIAL_LOCK
        self._failure: CommError | None = None
        self._finalize_risk: str | None = None
        self._notified = False  # every peer has been (or is being) told about the abort
        self._closed = False
        self._pending: set[_MPIRequest] = set()
        self._orphans: list[MPI.Request] = []  # requests that must finish before comm.Free
        self._keep: list[object] = []  # buffers of orphans
        self._ctl_buf = np.zeros(CONTROL_SIZE, dtype=np.uint8)
        self._ctl_status = mpi_module.Status()
        self._ctl_req: MPI.Request | None = comm.Irecv(
            [self._ctl_buf, mpi_module.BYTE], mpi_module.ANY_SOURCE, CONTROL_TAG)
        self.record_bytes = record_bytes(self.size)
        self._rec = np.zeros(self.record_bytes, dtype=np.uint8)
        self._rec_mv = self._rec.data
        self._recs = np.zeros((self.size, self.record_bytes), dtype=np.uint8)
        self._heads = self._recs[:, :RECORD_HEADER_BYTES]
        self.record_payloads: npt.NDArray[np.uint8] = self._recs[:, RECORD_HEADER_BYTES:]
        """The payload part of the records of the last :meth:`exchange_records`."""
        self._rec_req: MPI.Prequest | None = None  # the persistent all-gather, once started
        self._rec_persistent = True  # until the MPI library says it has no MPI_Allgather_init
        self._stream_status = mpi_module.Status()  # streams' tests (under the lock)
        self._stream_buffers: list[npt.NDArray[np.uint8]] = []  # streams' landing buffers
        _LIVE.add(self)
        _install_excepthook()

    @classmethod
    def create(cls, comm: object | None = None,
               timeout: float = DEFAULT_TIMEOUT) -> MPITransport:
        """Duplicate ``comm`` (default ``MPI.COMM_WORLD``) and build a transport on the copy.

        Collective: every rank of ``comm`` must call it. The duplicate gets the
        ``ERRORS_RETURN`` error handler so that MPI errors become Python exceptions. ``comm``
        may be any mpi4py intra-communicator: ``MPI.COMM_WORLD``, a communicator of the
        user's (``MPI.COMM_WORLD.Split(...)``), ... The first transport of the process installs
        the exit rules of the module docstring ("Failures at exit").
        Raises UsageError for a communicator that is not an mpi4py intra-communicator (naming
        its type), ``MPI.COMM_NULL`` or a bad ``timeout``, CommTimeoutError when the
        duplication does not complete within ``timeout`` seconds (some rank did not call
        ``create``).
        """
        if not timeout > 0:
            raise UsageError(f"timeout must be > 0 seconds, got {timeout!r}")
        mpi = _mpi()
        if comm is None:
            comm = mpi.COMM_WORLD
        if not isinstance(comm, mpi.Intracomm):
            kind = type(comm)
            raise UsageError("comm must be an mpi4py intra-communicator (mpi4py.MPI.Intracomm), "
                             f"got {kind.__module__}.{kind.__qualname__}")
        if comm == mpi.COMM_NULL:
            raise UsageError("comm is MPI.COMM_NULL")
        deadline = time.monotonic() + timeout

        def finish(req: MPI.Request, keep: tuple[object, ...], what: str) -> None:
            poller = _Poller()
            while not req.Test():
                now = time.monotonic()
                if now > deadline:
                    _LEAKED.extend((req, *keep))
                    err = CommTimeoutError(
                        f"{what} did not complete in {timeout} s: not every rank called "
                        "MPITransport.create")
                    _note_finalize_risk(f"a peer did not answer in time: {err}")
                    raise err
                poller.pause(now)

        newcomm, req = comm.Idup()
        finish(req, (newcomm,), "duplicating the communicator")
        newcomm.Set_errhandler(mpi.ERRORS_RETURN)
        newcomm.Set_name(f"bitcoll-{comm.Get_name() or 'comm'}")
        # Count the ranks on this node (same processor name) to detect oversubscription.
        digest = hashlib.blake2b(mpi.Get_processor_name().encode(), digest_size=8).digest()
        node = np.frombuffer(digest, dtype=np.uint64).copy()
        nodes = np.empty(newcomm.Get_size(), dtype=np.uint64)
        req = newcomm.Iallgather([node, mpi.UINT64_T], [nodes, mpi.UINT64_T])
        finish(req, (newcomm, node, nodes), "exchanging node names")
        local_ranks = int(np.count_nonzero(nodes == node[0]))
        transport = cls(newcomm, timeout, mpi)
        transport.oversubscribed = local_ranks > usable_cores()
        return transport

    def split(self, color: int | None, key: int = 0) -> MPITransport | None:
        """``MPI_Comm_split`` of this transport: a transport over the ranks of ``color``.

        Collective: every rank of this transport calls it (one at a time with its other
        collectives). ``color``: an integer >= 0, or None to stay out (this rank gets None).
        ``key`` (an integer) orders the ranks of the new transport, ties broken by rank here.
        The new transport has its own private communicator (so its frames never mix with this
        transport's or a sibling's, from any thread), abort channel, counters and ``close()``;
        it keeps the ``ERRORS_RETURN`` handler and inherits ``timeout`` and ``oversubscribed``
        (the count of ranks on this node that matters is the parent's: they all keep running).
        Closing this transport does not close it.

        Bounded: a non-blocking barrier on this transport (deadline: ``timeout`` seconds from
        now; an abort fails it) precedes the blocking ``MPI_Comm_split``, which every rank
        then has entered (module docstring). Raises UsageError for a bad ``color`` or ``key``
        (before anything is sent) or on a closed transport; CommTimeoutError when some rank
        does not call ``split`` in time, the transport's failure after an abort, CommError when
        MPI fails: after those the barrier may stay pending inside MPI, so abort this transport.
        """
        if color is not None and (isinstance(color, bool) or
                                  not isinstance(color, (int, np.integer)) or color < 0):
            raise UsageError(f"split color must be an integer >= 0 or None, got {color!r}")
        if isinstance(key, bool) or not isinstance(key, (int, np.integer)):
            raise UsageError(f"split key must be an integer, got {key!r}")
        mpi = self._mpi
        deadline = time.monotonic() + self.timeout
        self._run_collective("barrier before split", self._comm.Ibarrier, (), deadline)
        with self._lock:
            # Every rank passed the barrier and enters MPI_Comm_split now: do not stop for an
            # abort that arrived in the meantime (the others would wait in the split forever).
            if self._closed:
                raise UsageError("the MPI transport is closed")
            try:
                newcomm = self._comm.Split(mpi.UNDEFINED if color is None else int(color),
                                           int(key))
            except mpi.Exception as exc:
                err = CommError(f"MPI_Comm_split failed: {exc}")
                self._note_risk(str(err))
                self._fail(err, notify=True)
                raise err from exc
        if newcomm == mpi.COMM_NULL:
            return None
        newcomm.Set_errhandler(mpi.ERRORS_RETURN)
        newcomm.Set_name(f"{self._comm.Get_name() or 'bitcoll'}/split{int(color or 0)}")
        # Intracomm.Split returns an intra-communicator (mpi4py's stubs say Comm).
        transport = type(self)(cast("MPI.Intracomm", newcomm), self.timeout, mpi)
        transport.oversubscribed = self.oversubscribed
        return transport

    def subgroup(self, members: list[int], tag: str, timeout: float) -> MPITransport:
        """``MPI_Comm_create_group`` over ``members`` (new rank = position in the list), for
        :meth:`bitcoll.Communicator.split`, which has already exchanged every rank's color, so
        every member is about to call this too (the call blocks inside MPI until they have).
        Collective over ``members`` only; ``tag`` names the group among this transport's
        (hashed to the MPI tag). The new transport is wrapped like :meth:`split`'s. Raises
        UsageError when this rank is not a member or the transport is closed, the
        transport's failure after an abort, CommError when MPI fails."""
        if self.rank not in members:
            raise UsageError(f"rank {self.rank} is not among the members {members}")
        mpi = self._mpi
        with self._lock:
            self._check_usable()
            group = self._comm.Get_group()
            sub = group.Incl(members)
            try:
                newcomm = self._comm.Create_group(sub, zlib.crc32(tag.encode()) & 0x7FFF)
            except mpi.Exception as exc:
                err = CommError(f"MPI_Comm_create_group failed: {exc}")
                self._note_risk(str(err))
                self._fail(err, notify=True)
                raise err from exc
            finally:
                sub.Free()
                group.Free()
        newcomm.Set_errhandler(mpi.ERRORS_RETURN)
        newcomm.Set_name(f"{self._comm.Get_name() or 'bitcoll'}/group{tag}")
        transport = type(self)(newcomm, self.timeout, mpi)
        transport.oversubscribed = self.oversubscribed
        return transport

    # ---------------------------------------------------------------- state and failure

    @property
    def failure(self) -> CommError | None:
        """The error that aborted this transport, or None while it is healthy.

        Reading it also takes a non-blocking look at the abort channel, so an abort by a peer
        shows up here without any other call.
        """
        with self._lock:
            return self._check_failure()

    @property
    def comm(self) -> MPI.Intracomm:
        """The private communicator (for diagnostics; do not send on it)."""
        return self._comm

    @property
    def finalize_risk(self) -> str | None:
        """Why MPI_Finalize might hang because of this transport (the first recorded timeout
        or MPI error, see "Failures at exit" in the module docstring), or None."""
        return self._finalize_risk

    def _note_risk(self, reason: str) -> None:
        """Record a finalize risk (rule 2 of the module docstring)."""
        if self._finalize_risk is None:
            self._finalize_risk = reason
        _note_finalize_risk(reason)

    def _abort_nowait(self, reason: str, wait: float = 1.0) -> None:
        """:meth:`abort`, unless another thread holds the lock for more than ``wait`` s (in a
        blocking MPI call): used on the way to MPI_Abort, which must not be delayed."""
        if not self._lock.acquire(timeout=wait):
            return
        try:
            self.abort(reason)
        finally:
            self._lock.release()

    def _check_failure(self) -> CommError | None:
        """Poll the abort channel; return the failure (lock held)."""
        if self._failure is None and self._ctl_req is not None:
            self._poll_control()
        return self._failure

    def _poll_control(self) -> None:
        assert self._ctl_req is not None
        mpi = self._mpi
        try:
            arrived = self._ctl_req.Test(self._ctl_status)
        except mpi.Exception as exc:
            self._ctl_req = None
            self._note_risk(f"MPI failed to receive an abort notice: {exc}")
            self._fail(PeerLostError(f"garbled abort notice from a peer: {exc}"),
                       notify=False)
            return
        if not arrived:
            return
        self._ctl_req = None
        source = self._ctl_status.Get_source()
        reason = "(unreadable reason)"
        try:
            h = FrameHeader.unpack(self._ctl_buf.data[:HEADER_SIZE])
            if h.kind == FrameKind.ABORT and h.length <= CONTROL_SIZE - HEADER_SIZE:
                raw = self._ctl_buf[HEADER_SIZE:HEADER_SIZE + h.length].tobytes()
                reason = raw.decode("utf-8", errors="replace")
        except ProtocolError:
            pass
        # The aborting rank notifies every peer itself: no need to forward the notice.
        self._fail(PeerLostError(f"rank {source} aborted: {reason}"), notify=False)

    def _fail(self, error: CommError, notify: bool, reason: str | None = None) -> None:
        """Record the first failure, tell peers if asked (the notice carries ``reason``, by
        default the failure's message), stop pending receives (lock held)."""
        if self._failure is None:
            self._failure = error
        if notify and not self._notified and not self._closed:
            self._notify_peers(reason if reason is not None else str(self._failure))
        # A peer's abort reached us (or we told everyone): nobody needs to be told again.
        self._notified = True
        for req in list(self._pending):
            req._cancel()
            self._orphans.extend(req._reqs)
            self._keep.append(req._keep)
        self._pending.clear()

    def _notify_peers(self, reason: str) -> None:
        mpi = self._mpi
        if mpi.Is_finalized():
            return
        text = reason.encode("utf-8")[:CONTROL_SIZE - HEADER_SIZE]
        msg = np.zeros(CONTROL_SIZE, dtype=np.uint8)
        FrameHeader(seq=0, step=0, signature=0, length=len(text),
                    kind=FrameKind.ABORT).pack_into(msg.data)
        msg[HEADER_SIZE:HEADER_SIZE + len(text)] = np.frombuffer(text, dtype=np.uint8)
        self._keep.append(msg)
        for peer in range(self.size):
            if peer == self.rank:
                continue
            with contextlib.suppress(mpi.Exception):  # nothing better to do while failing
                self._orphans.append(self._comm.Isend([msg, mpi.BYTE], peer, CONTROL_TAG))

    def _check_usable(self) -> None:
        """Raise UsageError after close, the failure after an abort (lock held)."""
        if self._closed:
            raise UsageError("the MPI transport is closed")
        failure = self._check_failure()
        if failure is not None:
            raise failure.with_traceback(None)

    def _check_peer(self, peer: int) -> None:
        if not 0 <= peer < self.size:
            raise UsageError(f"peer {peer} is not a rank of this {self.size}-rank transport")

    # ---------------------------------------------------------------- frames

    def _frame_view(self, peer: int, payload: memoryview, header: FrameHeader,
                    writable: bool) -> memoryview:
        """The checks ``isend`` and ``irecv`` share: ``peer`` valid, ``payload`` a C-contiguous
        (writable) buffer of exactly ``header.length`` bytes, returned as a byte view;
        UsageError otherwise."""
        self._check_peer(peer)
        mv = byte_view(payload, writable=writable, what="payload")
        if header.length != mv.nbytes:
            raise UsageError(f"header.length is {header.length} but the payload has "
                             f"{mv.nbytes} bytes")
        return mv

    def isend(self, peer: int, payload: memoryview, header: FrameHeader) -> Request:
        """Start sending ``header`` + ``payload`` to ``peer``; see the module docstring.

        ``payload`` (any C-contiguous buffer) must stay alive and unmodified until the request
        completes; ``header.length`` must equal its size in bytes (UsageError otherwise). Raises
        the transport's failure after an abort.
        """
        mv = self._frame_view(peer, payload, header, writable=False)
        n = mv.nbytes
        mpi = self._mpi
        with self._lock:
            self._check_usable()
            if n <= INLINE_MAX:
                frame = np.empty(HEADER_SIZE + n, dtype=np.uint8)
                header.pack_into(frame.data)
                if n:
                    frame.data[HEADER_SIZE:] = mv
                reqs = [self._comm.Isend([frame, mpi.BYTE], peer, DATA_TAG)]
                keep: tuple[object, ...] = (frame,)
            else:
                hbuf = header.pack()
                reqs = [self._comm.Isend([hbuf, mpi.BYTE], peer, DATA_TAG),
                        self._comm.Isend([mv, mpi.BYTE], peer, DATA_TAG)]
                keep = (hbuf, mv)
            req = _SendRequest(self, reqs, keep, peer, header)
            self._pending.add(req)
        self.stats.add_sent(HEADER_SIZE + n)
        return req

    def irecv(self, peer: int, payload: memoryview, header: FrameHeader) -> Request:
        """Post a receive of the next frame from ``peer`` into ``payload``.

        ``payload`` (writable, C-contiguous) must hold exactly ``header.length`` bytes
        (UsageError otherwise) and must stay alive until the request completes; after a
        failure it may still be written by MPI if the receive could not be cancelled. The
        request fails with ProtocolError (and aborts the transport) when the frame's header
        differs from ``header``, its size disagrees with its header, or it is longer than
        posted. Raises the transport's failure after an abort.
        """
        mv = self._frame_view(peer, payload, header, writable=True)
        n = mv.nbytes
        mpi = self._mpi
        staging = np.empty(HEADER_SIZE + INLINE_MAX, dtype=np.uint8)
        with self._lock:
            self._check_usable()
            reqs = [self._comm.Irecv([staging, mpi.BYTE], peer, DATA_TAG)]
            if n > INLINE_MAX:
                reqs.append(self._comm.Irecv([mv, mpi.BYTE], peer, DATA_TAG))
            req = _RecvRequest(self, reqs, (staging, mv), peer, header, staging, mv)
            self._pending.add(req)
        return req

    streams = True

    def stream_folds(self, dtype: np.dtype[Any], op: str) -> bool:
        """Every fold: a stream folds with the frame path's own :func:`~bitcoll.ops.reduce_into`."""
        return op in _STREAM_OPS

    def stream(self, out_peer: int, in_peer: int, plan: StreamPlan, deadline: float) -> bool:
        """Run ``plan`` (:meth:`Transport.stream`): its sends to ``out_peer`` and receives from
        ``in_peer`` as exactly the MPI messages of the equivalent ``isend``/``irecv`` calls
        (so a rank that streams and one that makes the frames one by one work together), on
        the calling thread, with no request object per frame (see :class:`_StreamRun`).
        Never declines (MPI keeps frames in order behind any already posted), so it returns
        True once every frame is done. Errors as ``Request.wait``: ProtocolError for a frame
        that is not the expected one, the failure after an abort, CommTimeoutError past
        ``deadline``; any of them, a timeout included, fails the transport (peers are told),
        as a stream half done cannot be resumed. The transport keeps the landing buffers of
        folded frames (two, as long as the longest folded frame) for the next stream."""
        self._check_peer(out_peer)
        self._check_peer(in_peer)
        if any(not -1 <= after < len(plan.recvs) for *_, after in plan.sends):
            raise UsageError("a stream plan's send forwards a receive the plan does not have")
        _StreamRun(self, out_peer, in_peer, plan).run(deadline)
        return True

    def _take_stream_buffers(self) -> list[npt.NDArray[np.uint8]]:
        """The landing buffers for a stream (lock held); given back when it ends well."""
        bufs, self._stream_buffers = self._stream_buffers, []
        return bufs

    def _give_stream_buffers(self, bufs: list[npt.NDArray[np.uint8]]) -> None:
        self._stream_buffers = bufs

    # ---------------------------------------------------------------- abort / close

    def abort(self, reason: str) -> None:
        """Fail every pending and future request here and on every peer.

        Peers fail with ``PeerLostError("rank <r> aborted: <reason>")`` at their next test of
        any request (within milliseconds while they wait). On this rank ``failure`` becomes
        ``CommError("rank <r> aborted: <reason>")`` unless an earlier error is already recorded
        (that one is kept). Idempotent; never raises; peers are notified at most once.
        """
        with self._lock:
            if self._closed:
                return
            self._check_failure()
            if self._failure is None:
                self._failure = CommError(f"rank {self.rank} aborted: {reason}")
            self._fail(self._failure, notify=True, reason=reason)

    def close(self) -> None:
        """Cancel outstanding receives and free the private communicator. Idempotent.

        Pending requests fail with CommError afterwards, later calls with UsageError.
        Outstanding MPI operations get :data:`CLOSE_DRAIN_SECONDS` to finish; if some cannot (a
        send to a peer that will never receive it, a collective a peer never joined), the
        communicator is left unfreed rather than risking a hang. An aborted communicator is
        never freed (see the comment below). Never raises.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            _LIVE.discard(self)
            mpi = self._mpi
            finalized = mpi.Is_finalized()
            for req in list(self._pending):
                if not finalized:
                    req._cancel()
                req._error = CommError("the MPI transport was closed before this request "
                                       "completed")
                self._orphans.extend(req._reqs)
                self._keep.append(req._keep)
            self._pending.clear()
            if finalized:
                self._ctl_req = None
                return
            if self._ctl_req is not None:
                with contextlib.suppress(mpi.Exception):
                    self._ctl_req.Cancel()
                self._orphans.append(self._ctl_req)
                self._ctl_req = None
            self._keep.append(self._ctl_buf)
            rec_req, self._rec_req = self._rec_req, None
            if rec_req is not None:  # persistent: finish a started exchange, then free it
                self._orphans.append(rec_req)
                self._keep.append((self._rec, self._recs))
            deadline = time.monotonic() + CLOSE_DRAIN_SECONDS
            poller = _Poller(self.oversubscribed)
            while self._orphans:
                try:
                    if self._orphans[-1].Test():
                        self._orphans.pop()
                        continue
                except mpi.Exception:
                    self._orphans.pop()  # completed in error: nothing left to wait for
                    continue
                now = time.monotonic()
                if now > deadline:
                    break
                poller.pause(now)
            if rec_req is not None and not any(r is rec_req for r in self._orphans):
                with contextlib.suppress(mpi.Exception):
                    rec_req.Free()
            if self._orphans or self._failure is not None:
                # An aborted communicator is never freed: MPI may recycle its context id for
                # a later communicator, and a peer's abort notice still in flight would then
                # abort that one.
                _LEAKED.extend((self._comm, self._orphans, self._keep))
            else:
                try:
                    self._comm.Free()
                except mpi.Exception:  # pragma: no cover
                    _LEAKED.append(self._comm)
            self._orphans = []
            self._keep = []

    def __enter__(self) -> MPITransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("failed" if self._failure else "ok")
        return f"MPITransport(rank={self.rank}, size={self.size}, {state})"

    # ---------------------------------------------------------------- native collectives

    def _run_collective(self, what: str | Callable[[], str], start: Callable[[], MPI.Request],
                        keep: tuple[object, ...], deadline: float) -> None:
        """Start one non-blocking MPI collective under the lock and wait for it.
        ``what`` names it in errors (a callable is called only then)."""
        with self._lock:
            self._check_usable()
            req = start()
        self._await(req, keep, what, deadline)

    def _await(self, req: MPI.Request, keep: tuple[object, ...],
               what: str | Callable[[], str], deadline: float) -> None:
        """Wait for the started collective ``req`` (``keep``: buffers MPI may still touch):
        :data:`COLLECTIVE_SPIN_TESTS` plain tests first (a small collective between ranks that
        arrive together completes within them, without the wait loop's bookkeeping), then the
        wait loop with its deadline and abort checks."""
        lock = self._lock
        try:
            for _ in range(OVERSUBSCRIBED_SPIN_TESTS if self.oversubscribed
                           else COLLECTIVE_SPIN_TESTS):
                with lock:
                    if req.Test():
                        return
        except self._mpi.Exception as exc:
            raise self._collective_failed(what, exc) from exc
        with lock:
            waiter = _CollectiveRequest(self, req, keep, what)
            self._pending.add(waiter)
        waiter.wait(deadline)

    def _collective_failed(self, what: str | Callable[[], str], exc: BaseException
                           ) -> CommError:
        """The CommError of a native collective that MPI failed with ``exc``, after failing
        the transport with it (peers notified): the one place for that."""
        err = CommError(f"MPI {what if isinstance(what, str) else what()} failed: {exc}")
        with self._lock:
            self._note_risk(str(err))
            self._fail(err, notify=True)
        return err

    def _reduce_type(self, dt: np.dtype[Any], op: str) -> tuple[MPI.Datatype, MPI.Op]:
        """The MPI datatype and op of a native reduction of elements of ``dt``; UsageError
        when MPI cannot reduce that dtype (nothing is sent then).

        The table names MPI's fixed-width predefined types rather than asking
        ``mpi4py.util.dtlib.from_numpy_dtype`` (see the module docstring): that would
        allocate a datatype per call and accept float16 (``MPIX_C_FLOAT16``, an MPICH
        extension), bool (``MPI_C_BOOL``: logical operations only) and long double. Looked
        up by ``(dtype, op)`` in a cache, so a call costs one dictionary lookup."""
        key = (dt, op)
        hit = _REDUCE_CACHE.get(key)
        if hit is not None:
            return hit
        if op not in _REDUCE_OPS:
            raise UsageError(f"native reduction op must be one of {_REDUCE_OPS}, got {op!r}")
        if not dt.isnative:
            raise UsageError(f"native collectives need native byte order, got {dt}")
        table = _reduce_table(self._mpi, op)
        mpitype = table.get(dt.name)
        if mpitype is None:
            raise UsageError(f"native {op} reductions do not support dtype {dt} "
                             "(supported: " + ", ".join(sorted(table)) + ")")
        mpi = self._mpi
        mpiop = {"sum": mpi.SUM, "max": mpi.MAX, "min": mpi.MIN}[op]
        _REDUCE_CACHE[key] = (mpitype, mpiop)
        return mpitype, mpiop

    @staticmethod
    def _check_array(arr: object, what: str, *, writable: bool) -> npt.NDArray[Any]:
        if not isinstance(arr, np.ndarray):
            raise UsageError(f"{what} must be a numpy array, got {type(arr)!r}")
        if not arr.flags.c_contiguous:
            raise UsageError(f"{what} must be C-contiguous")
        if writable and not arr.flags.writeable:
            raise UsageError(f"{what} must be writable")
        return arr

    @staticmethod
    def _same_buffer(a: npt.NDArray[Any], b: npt.NDArray[Any]) -> bool:
        """True when a and b are the very same memory; UsageError on partial overlap."""
        if a is b:
            return True
        if a.nbytes == 0 or b.nbytes == 0 or not np.may_share_memory(a, b):
            return False
        if a.ctypes.data == b.ctypes.data and a.nbytes == b.nbytes:
            return True
        raise UsageError("send and recv buffers overlap partially")

    def native_allreduce(self, send: npt.NDArray[Any], recv: npt.NDArray[Any], op: str,
                         deadline: float) -> None:
        """MPI ``Iallreduce``: ``recv = op(send of every rank)`` elementwise.

        ``send`` and ``recv`` are C-contiguous numpy arrays of one dtype and size (``recv``
        may be ``send`` itself: in place). ``op`` is "sum", "max" or "min". Supported dtypes:
        int8-64, uint8-64, float32, float64 (and complex64/128 for "sum"); anything else
        (float16, bool, ...) raises UsageError before anything is sent, so the caller can fall
        back to a bitcoll algorithm. Raises CommTimeoutError past ``deadline``, the transport's
        failure after an abort.
        """
        send = self._check_array(send, "send", writable=False)
        recv = self._check_array(recv, "recv", writable=True)
        if send.dtype != recv.dtype or send.size != recv.size:
            raise UsageError(f"send ({send.dtype}[{send.size}]) and recv "
                             f"({recv.dtype}[{recv.size}]) differ in dtype or size")
        run = self.prepared_allreduce(recv.dtype, op)  # UsageError for an unreducible dtype
        with self._lock:
            self._check_usable()  # the abort channel too: this path is not the hot one
        run(recv if self._same_buffer(send, recv) else send, recv, deadline)

    def prepared_allreduce(self, dtype: np.dtype[Any], op: str
                           ) -> Callable[[npt.NDArray[Any], npt.NDArray[Any], float], None]:
        """:meth:`native_allreduce` of ``dtype`` with ``op``, its checks done once (the
        all-reduce fast path calls it with arrays it has checked itself): ``run(send, recv,
        deadline)`` requires C-contiguous numpy arrays of ``dtype`` and one size, ``recv``
        writable, and either the same array (in place) or not overlapping; errors as
        :meth:`native_allreduce`. UsageError now when MPI cannot reduce ``dtype`` with
        ``op``. Per call it skips the array checks and polls the abort channel only from the
        wait loop (about 1.5 us less than :meth:`native_allreduce`, 2 ranks)."""
        mpitype, mpiop = self._reduce_type(dtype, op)
        in_place = self._mpi.IN_PLACE
        lock = self._lock

        def run(send: npt.NDArray[Any], recv: npt.NDArray[Any], deadline: float) -> None:
            with lock:
                if self._failure is not None or self._closed:
                    self._check_usable()
                req = self._comm.Iallreduce(in_place if send is recv else [send, mpitype],
                                            [recv, mpitype], mpiop)
            self._await(req, (send, recv), lambda: f"allreduce({op}, {dtype}[{recv.size}])",
                        deadline)
        return run

    def reducible(self, dtype: np.dtype[Any], op: str) -> bool:
        """Whether :meth:`native_allreduce` can reduce ``dtype`` with ``op`` (no error)."""
        key = (dtype, op)
        if key in _REDUCE_CACHE:
            return True
        try:
            self._reduce_type(dtype, op)
        except UsageError:
            return False
        return True

    def exchange_records(self, seq: int, signature: int, payload: memoryview | None,
                         deadline: float) -> tuple[bool, npt.NDArray[np.uint8]]:
        """One MPI all-gather of a fixed-size record per rank (see "Argument records" in the
        module docstring): this rank's record is ``seq`` and ``signature`` (int64 little
        endian, the :data:`RECORD_HEADER_BYTES`-byte header; each within int64) followed by
        ``payload`` (a byte memoryview of at most ``record_bytes - 16`` bytes, or None).

        Collective; every rank calls it with its own values. Returns ``(agree, payloads)``:
        ``agree`` is True exactly when every rank passed this rank's ``seq`` and
        ``signature`` (the same on every rank: they all see the same records), ``payloads``
        a ``(size, record_bytes - 16)`` uint8 array whose row r starts with rank r's payload
        (bytes past it are unspecified). The array is a view of the transport's own buffer,
        the same object on every call (:attr:`record_payloads`): valid until the next
        exchange. UsageError for a payload that does not fit (nothing is sent); errors as
        :meth:`native_allreduce`.
        """
        rec = self._rec_mv
        if payload is not None:
            n = payload.nbytes
            if n > self.record_bytes - RECORD_HEADER_BYTES:
                raise UsageError(f"a record payload holds at most "
                                 f"{self.record_bytes - RECORD_HEADER_BYTES} bytes, got {n}")
            rec[RECORD_HEADER_BYTES:RECORD_HEADER_BYTES + n] = payload
        head = _RECORD_HEADER.pack(seq, signature)
        rec[:RECORD_HEADER_BYTES] = head
        with self._lock:
            # Only the cheap look here: an abort that arrives meanwhile is seen by the wait.
            if self._failure is not None or self._closed:
                self._check_usable()
            persistent = self._rec_req
            if persistent is None:
                req = self._start_records()
            else:
                persistent.Start()
                req = persistent
            try:
                done = req.Test()
            except self._mpi.Exception as exc:
                raise self._collective_failed(_RECORDS, exc) from exc
        if not done:
            self._await(req, (), _RECORDS, deadline)
        return self._heads.tobytes() == head * self.size, self.record_payloads

    def _start_records(self) -> MPI.Request:
        """Start the first record all-gather (lock held; closed or failed transports were
        refused): create the persistent request (every rank's first exchange, so in the same
        order everywhere) and start it, or start an ``Iallgather`` where MPI has no persistent
        collectives (then again at every exchange)."""
        mpi = self._mpi
        send, recv = [self._rec, mpi.BYTE], [self._recs, mpi.BYTE]
        if self._rec_persistent:
            try:
                req = self._comm.Allgather_init(send, recv)
            except (NotImplementedError, AttributeError):
                self._rec_persistent = False
            else:
                self._rec_req = req
                req.Start()
                return req
        return self._comm.Iallgather(send, recv)

    def native_extremes(self, values: Sequence[int], deadline: float
                        ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """The largest and the smallest of each of ``values`` over the ranks: one MPI
        all-reduce (MAX) of ``values`` and their negatives, a fixed-size int64 message.

        Collective; every rank passes the same number of values (at most 16, each within
        int64 and not ``-2**63``) and gets the same ``(hi, lo)``. ``hi == lo`` everywhere
        exactly when every rank passed the same values: this is how a caller checks, before
        an MPI collective that carries no frame headers, that every rank called it with the
        same arguments (the check cannot mismatch itself: its size never varies). UsageError
        for a bad ``values``; errors as :meth:`native_allreduce`.
        """
        k = len(values)
        if not 0 < k <= _EXTREMES_LANES:
            raise UsageError(f"native_extremes takes 1 to {_EXTREMES_LANES} values, got {k}")
        check = np.empty(2 * _EXTREMES_LANES, dtype=np.int64)
        try:
            check[:k] = values
        except (OverflowError, TypeError, ValueError) as exc:
            raise UsageError(f"native_extremes values must be int64 integers: {exc}") from None
        check[k:_EXTREMES_LANES] = 0
        np.negative(check[:_EXTREMES_LANES], out=check[_EXTREMES_LANES:])
        seen = np.empty_like(check)
        mpi = self._mpi
        self._run_collective("argument check", lambda: self._comm.Iallreduce(
            [check, mpi.INT64_T], [seen, mpi.INT64_T], mpi.MAX), (check, seen), deadline)
        return seen[:k], -seen[_EXTREMES_LANES:_EXTREMES_LANES + k]

    def native_reduce_scatter(self, send: npt.NDArray[Any], recv: npt.NDArray[Any],
                              counts: list[int], op: str, deadline: float) -> None:
        """MPI ``Ireduce_scatter``: rank r receives block r of ``op(send of every rank)``.

        ``counts`` (one non-negative int per rank) cuts ``send`` (``sum(counts)`` elements)
        into consecutive blocks; ``recv`` holds ``counts[rank]`` elements of the same dtype.
        Buffers must not overlap. Dtypes, ops and errors as :meth:`native_allreduce`.
        """
        send = self._check_array(send, "send", writable=False)
        recv = self._check_array(recv, "recv", writable=True)
        cnts = self._check_counts(counts)
        if send.dtype != recv.dtype:
            raise UsageError(f"send ({send.dtype}) and recv ({recv.dtype}) dtypes differ")
        if send.size != sum(cnts) or recv.size != cnts[self.rank]:
            raise UsageError(f"send has {send.size} elements and recv {recv.size}, expected "
                             f"sum(counts)={sum(cnts)} and counts[{self.rank}]={cnts[self.rank]}")
        if self._same_buffer(send, recv):
            raise UsageError("send and recv must not be the same buffer")
        mpitype, mpiop = self._reduce_type(recv.dtype, op)
        self._run_collective(
            f"reduce_scatter({op}, {recv.dtype}[{send.size}])",
            lambda: self._comm.Ireduce_scatter([send, mpitype], [recv, mpitype], cnts, mpiop),
            (send, recv), deadline)

    def _check_counts(self, counts: Sequence[int]) -> list[int]:
        try:
            cnts = [int(c) for c in counts]
        except (TypeError, ValueError) as exc:
            raise UsageError(f"counts must be a list of ints, got {counts!r}") from exc
        if len(cnts) != self.size or any(c < 0 for c in cnts):
            raise UsageError(f"counts must hold {self.size} non-negative ints, got {counts!r}")
        return cnts

    def native_allgather(self, send: npt.NDArray[Any], recv: npt.NDArray[Any],
                         deadline: float) -> None:
        """MPI ``Iallgather``: ``recv`` = the ``send`` arrays of ranks 0..size-1, concatenated.

        ``recv`` has ``size * send.size`` elements of ``send``'s dtype (any dtype: the bytes are
        moved as they are). Buffers must not overlap. Raises UsageError, CommTimeoutError past
        ``deadline``, the transport's failure after an abort.
        """
        send = self._check_array(send, "send", writable=False)
        recv = self._check_array(recv, "recv", writable=True)
        if send.dtype != recv.dtype or recv.size != send.size * self.size:
            raise UsageError(f"recv must hold {self.size} x {send.size} elements of "
                             f"{send.dtype}, got {recv.dtype}[{recv.size}]")
        if self._same_buffer(send, recv):
            raise UsageError("send and recv must not be the same buffer")
        byte = self._mpi.BYTE
        self._run_collective(
            f"allgather({send.dtype}[{send.size}])",
            lambda: self._comm.Iallgather([send, send.nbytes, byte], [recv, send.nbytes, byte]),
            (send, recv), deadline)

    def native_bcast(self, buf: npt.NDArray[Any], root: int, deadline: float) -> None:
        """MPI ``Ibcast``: every rank's ``buf`` receives the content of ``root``'s ``buf``.

        ``buf`` is a C-contiguous numpy array of any dtype, of the same byte size on every
        rank (writable except on the root). Raises UsageError, CommTimeoutError past
        ``deadline``, the transport's failure after an abort.
        """
        self._check_peer(root)
        buf = self._check_array(buf, "buf", writable=self.rank != root)
        byte = self._mpi.BYTE
        self._run_collective(
            f"bcast({buf.dtype}[{buf.size}], root={root})",
            lambda: self._comm.Ibcast([buf, buf.nbytes, byte], root), (buf,), deadline)

    def native_alltoall(self, send: npt.NDArray[Any], recv: npt.NDArray[Any],
                        deadline: float) -> None:
        """MPI ``Ialltoall``: block j of ``send`` goes to rank j, block i of ``recv`` comes
        from rank i.

        ``send`` and ``recv`` have the same dtype (any) and size, a multiple of ``size``;
        blocks are ``size``-th parts in order. Buffers must not overlap. Raises UsageError,
        CommTimeoutError past ``deadline``, the transport's failure after an abort.
        """
        send = self._check_array(send, "send", writable=False)
        recv = self._check_array(recv, "recv", writable=True)
        if send.dtype != recv.dtype or send.size != recv.size or send.size % self.size:
            raise UsageError(f"send ({send.dtype}[{send.size}]) and recv "
                             f"({recv.dtype}[{recv.size}]) must have one dtype and one size, a "
                             f"multiple of {self.size}")
        if self._same_buffer(send, recv):
            raise UsageError("send and recv must not be the same buffer")
        block = send.nbytes // self.size
        byte = self._mpi.BYTE
        self._run_collective(
            f"alltoall({send.dtype}[{send.size}])",
            lambda: self._comm.Ialltoall([send, block, byte], [recv, block, byte]),
            (send, recv), deadline)

    def native_barrier(self, deadline: float) -> None:
        """MPI ``Ibarrier``: return once every rank entered it. Raises CommTimeoutError past
        ``deadline``, the transport's failure after an abort."""
        self._run_collective("barrier", self._comm.Ibarrier, (), deadline)


if TYPE_CHECKING:
    _NATIVE_CHECK: type[NativeCollectives] = MPITransport  # mypy: MPI has the native collectives
