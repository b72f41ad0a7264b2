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
  is **one** MPI message: the 40-byte header followed by the payload (the payload is copied
  into a small staging buffer; a copy of a few KiB costs less than a second message). A larger
  frame is **two** consecutive MPI messages on the same tag: the 40-byte header, then the
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
the wait loop. A larger all-reduce, up to the communicator's native threshold, is the
exchange then MPI's own all-reduce, a persistent one where the ranks' records agree that each
holds one for the call's arrays (:meth:`MPITransport.prepared_checked_allreduce`,
:mod:`bitcoll.transport.mpi.persistent`).

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

Failures at exit: see :mod:`bitcoll.transport.mpi.lifecycle`. Launcher detection:
:mod:`bitcoll.transport.mpi.launcher`. The frame messages and their wait loop:
:mod:`bitcoll.transport.mpi.requests`; streams: :mod:`bitcoll.transport.mpi.stream`.
"""

from __future__ import annotations

import contextlib
import hashlib
import struct
import threading
import time
import weakref
import zlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Final, cast

import numpy as np
import numpy.typing as npt

from ...config import DEFAULT_TIMEOUT
from ...errors import CommError, CommTimeoutError, PeerLostError, ProtocolError, UsageError
from ...topology import usable_cores
from ..base import (
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
from .launcher import _mpi
from .lifecycle import _LEAKED, _LIVE, _install_excepthook, _note_finalize_risk
from .persistent import BID, NO_BID, NUMBER, REPEAT_BID, Persistent, PersistentAllreduces
from .requests import (
    CONTROL_SIZE,
    CONTROL_TAG,
    DATA_TAG,
    INLINE_MAX,
    _CollectiveRequest,
    _MPIRequest,
    _Poller,
    _RecvRequest,
    _SendRequest,
)
from .stream import _STREAM_OPS, _StreamRun

if TYPE_CHECKING:
    from mpi4py import MPI

__all__ = ["MPITransport", "record_bytes"]

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
_NO_PAYLOAD: Final = bytes(RECORD_MIN_BYTES - RECORD_HEADER_BYTES)
"""What a record without a payload carries (so that no stale bytes of an earlier one are
read as one: :meth:`MPITransport.prepared_checked_allreduce`'s bids)."""
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

# All transports share this lock when MPI runs below THREAD_MULTIPLE.
_SERIAL_LOCK = threading.RLock()

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
        self._persist = PersistentAllreduces(self.size)
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
            raise UsageError(f"timeout must be > 0 seconds, got {timeout!r}", argument="timeout")
        mpi = _mpi()
        if comm is None:
            comm = mpi.COMM_WORLD
        if not isinstance(comm, mpi.Intracomm):
            kind = type(comm)
            raise UsageError("comm must be an mpi4py intra-communicator (mpi4py.MPI.Intracomm), "
                             f"got {kind.__module__}.{kind.__qualname__}", argument="comm")
        if comm == mpi.COMM_NULL:
            raise UsageError("comm is MPI.COMM_NULL", argument="comm")
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
            raise UsageError(f"split color must be an integer >= 0 or None, got {color!r}",
                             argument="color")
        if isinstance(key, bool) or not isinstance(key, (int, np.integer)):
            raise UsageError(f"split key must be an integer, got {key!r}", argument="key")
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
                             f"{mv.nbytes} bytes", argument="payload")
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
            raise UsageError("a stream plan's send forwards a receive the plan does not have",
                             argument="plan")
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
                self._persist.release()
                return
            if self._ctl_req is not None:
                with contextlib.suppress(mpi.Exception):
                    self._ctl_req.Cancel()
                self._orphans.append(self._ctl_req)
                self._ctl_req = None
            self._keep.append(self._ctl_buf)
            rec_req, self._rec_req = self._rec_req, None
            persistent = self._persist.release()
            if rec_req is not None:
                persistent.append((rec_req, (self._rec, self._recs)))
            for preq, buffers in persistent:  # finish a started one, then free it
                self._orphans.append(preq)
                self._keep.append(buffers)
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
            for preq, _ in persistent:
                if not any(r is preq for r in self._orphans):
                    with contextlib.suppress(mpi.Exception):
                        preq.Free()
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
        :meth:`_spin` first, then the wait loop with its deadline and abort checks, under one
        taking of the lock."""
        with self._lock:
            waiter = self._pend(req, keep, what)
        if waiter is not None:
            waiter.wait(deadline)

    def _pend(self, req: MPI.Request, keep: tuple[object, ...],
              what: str | Callable[[], str]) -> _CollectiveRequest | None:
        """Lock held: :meth:`_spin`; None when ``req`` completed within it, else the wait
        loop's request for it, registered (the caller waits for it after the lock)."""
        if self._spin(req, what):
            return None
        waiter = _CollectiveRequest(self, req, keep, what)
        self._pending.add(waiter)
        return waiter

    def _spin(self, req: MPI.Request, what: str | Callable[[], str]) -> bool:
        """Whether the started collective ``req`` completes within
        :data:`COLLECTIVE_SPIN_TESTS` plain tests (:data:`OVERSUBSCRIBED_SPIN_TESTS` on an
        oversubscribed node): a small collective between ranks that arrive together does,
        without the wait loop's bookkeeping. Lock held, the whole spin under it (a few tens
        of microseconds at most: taking it per test cost about 0.4 us per small call).
        CommError (the transport failed) when MPI fails the test."""
        test = req.Test
        try:
            for _ in range(OVERSUBSCRIBED_SPIN_TESTS if self.oversubscribed
                           else COLLECTIVE_SPIN_TESTS):
                if test():
                    return True
        except self._mpi.Exception as exc:
            raise self._collective_failed(what, exc) from exc
        return False

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
            raise UsageError(f"native reduction op must be one of {_REDUCE_OPS}, got {op!r}",
                             argument="op")
        if not dt.isnative:
            raise UsageError(f"native collectives need native byte order, got {dt}",
                             argument="send")
        table = _reduce_table(self._mpi, op)
        mpitype = table.get(dt.name)
        if mpitype is None:
            raise UsageError(f"native {op} reductions do not support dtype {dt} "
                             "(supported: " + ", ".join(sorted(table)) + ")", argument="send")
        mpi = self._mpi
        mpiop = {"sum": mpi.SUM, "max": mpi.MAX, "min": mpi.MIN}[op]
        _REDUCE_CACHE[key] = (mpitype, mpiop)
        return mpitype, mpiop

    @staticmethod
    def _check_array(arr: object, what: str, *, writable: bool) -> npt.NDArray[Any]:
        if not isinstance(arr, np.ndarray):
            raise UsageError(f"{what} must be a numpy array, got {type(arr)!r}", argument=what)
        if not arr.flags.c_contiguous:
            raise UsageError(f"{what} must be C-contiguous", argument=what)
        if writable and not arr.flags.writeable:
            raise UsageError(f"{what} must be writable", argument=what)
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
        raise UsageError("send and recv buffers overlap partially", argument="recv")

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

    def prepared_checked_allreduce(self, dtype: np.dtype[Any], count: int, op: str
                                   ) -> Callable[[int, int, npt.NDArray[Any], npt.NDArray[Any],
                                                  float], bool]:
        """The argument check (:meth:`exchange_records`) then MPI's all-reduce of ``count``
        elements of ``dtype`` with ``op``, both prepared once: ``run(seq, signature, send,
        recv, deadline)`` returns False, having reduced nothing, when the records disagree;
        else ``recv = op(send of every rank)`` and True. Arrays as :meth:`prepared_allreduce`
        requires (``count`` elements); ``recv is send`` reduces in place. UsageError now when
        :meth:`reducible` is False; errors per call as :meth:`native_allreduce`.

        The all-reduce is a persistent MPI collective (``MPI_Allreduce_init``, then started at
        each call; :mod:`bitcoll.transport.mpi.persistent`), bound to the arrays of the call
        that made it, about 1.5-2 us less per call than a fresh ``MPI_Iallreduce`` (2 ranks,
        8-256 KiB). The record carries this rank's bid: the number of the persistent
        all-reduce it holds for these very arrays (the same objects as when it was made), and
        whether it would use one (it holds one, or the arrays are the very objects of the
        plan's previous call). When every rank would and all name the same one, it is started;
        when every rank would but they name different ones (or none), every rank makes a new
        one for its own arrays, replacing the plan's previous one; otherwise (arrays new at
        each call, a rank on the general path, whose record carries no bid) the call is a
        plain ``MPI_Iallreduce``. A plan so keeps references to the two arrays of its
        persistent all-reduce (freed with it: at most
        :data:`~bitcoll.transport.mpi.persistent.PERSISTENT_ALLREDUCES` per transport, and at
        close). Where MPI has no persistent collectives: ``MPI_Iallreduce``.
        """
        mpitype, mpiop = self._reduce_type(dtype, op)
        records = self.prepared_records(BID.size)
        at = RECORD_HEADER_BYTES
        numbers = self._recs[:, at:at + NUMBER.size]
        willing = self._recs[:, at + NUMBER.size:at + BID.size]
        all_willing = b"\x01" * self.size
        in_place, lock, comm, persist = self._mpi.IN_PLACE, self._lock, self._comm, self._persist
        mpi_exception = self._mpi.Exception
        last: list[Persistent | None] = [None]  # the plan's persistent all-reduce
        # The arrays of the plan's last call without a persistent all-reduce: ``send``'s id
        # and a weak reference to ``recv`` (an array made for one call, as ``out=None``
        # makes, is gone by the next, so its place cannot be mistaken for it).
        seen: list[tuple[int, weakref.ref[Any]] | None] = [None]

        def what() -> str:
            return f"allreduce({op}, {dtype}[{count}])"

        def run(seq: int, signature: int, send: npt.NDArray[Any], recv: npt.NDArray[Any],
                deadline: float) -> bool:
            held = last[0]
            if held is not None and held.send is send and held.recv is recv:
                bid = held.bid
            else:
                held = None
                was = seen[0]
                if was is not None and was[1]() is recv and was[0] == id(send):
                    bid = REPEAT_BID
                else:
                    bid = NO_BID
                    seen[0] = (id(send), weakref.ref(recv))
            if not records(seq, signature, bid, deadline):
                return False
            sendspec = in_place if send is recv else [send, mpitype]
            with lock:
                if self._failure is not None or self._closed:
                    self._check_usable()
                try:
                    if willing.tobytes() != all_willing:
                        held = None
                    elif held is None or numbers.tobytes() != held.agreed:
                        held = persist.make(
                            lambda: comm.Allreduce_init(sendspec, [recv, mpitype], mpiop),
                            send, recv, last[0])
                        last[0] = held
                    if held is None:
                        req = comm.Iallreduce(sendspec, [recv, mpitype], mpiop)
                    else:
                        req = cast("MPI.Prequest", held.req)
                        req.Start()
                except mpi_exception as exc:
                    raise self._collective_failed(what, exc) from exc
            self._await(req, (send, recv), what, deadline)
            return True
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
        (bytes past it are unspecified; without a payload, 16 zero bytes). The array is a
        view of the transport's own buffer, the same object on every call
        (:attr:`record_payloads`): valid until the next exchange. UsageError for a payload
        that does not fit (nothing is sent); errors as :meth:`native_allreduce`.
        """
        rec = self._rec_mv
        if payload is not None:
            n = payload.nbytes
            if n > self.record_bytes - RECORD_HEADER_BYTES:
                raise UsageError(f"a record payload holds at most "
                                 f"{self.record_bytes - RECORD_HEADER_BYTES} bytes, got {n}",
                                 argument="payload")
            rec[RECORD_HEADER_BYTES:RECORD_HEADER_BYTES + n] = payload
        else:
            rec[RECORD_HEADER_BYTES:RECORD_MIN_BYTES] = _NO_PAYLOAD
        head = _RECORD_HEADER.pack(seq, signature)
        rec[:RECORD_HEADER_BYTES] = head
        return self._gather_records(head, deadline), self.record_payloads

    def _gather_records(self, head: bytes, deadline: float) -> bool:
        """The record all-gather of :meth:`exchange_records`, this rank's record written (its
        header ``head``): whether every rank's header is ``head``."""
        with self._lock:
            # Only the cheap look here: an abort that arrives meanwhile is seen by the wait.
            if self._failure is not None or self._closed:
                self._check_usable()
            persistent = self._rec_req
            req: MPI.Request
            if persistent is None:
                req = self._start_records()
            else:
                persistent.Start()
                req = persistent
            waiter = self._pend(req, (), _RECORDS)
        if waiter is not None:
            waiter.wait(deadline)
        return self._heads.tobytes() == head * self.size

    def prepared_records(self, nbytes: int
                         ) -> Callable[[int, int, bytes | memoryview, float], bool]:
        """:meth:`exchange_records` for payloads of exactly ``nbytes`` bytes, its checks done
        once (the all-reduce fast path's inline plans): ``run(seq, signature, payload,
        deadline)`` returns ``agree``; the payloads are in :attr:`record_payloads` as there.
        ``payload``: ``nbytes`` bytes (bytes, or a byte memoryview). UsageError now when
        ``nbytes`` does not fit a record; errors per call as :meth:`exchange_records`."""
        end = RECORD_HEADER_BYTES + nbytes
        if not 0 <= nbytes <= self.record_bytes - RECORD_HEADER_BYTES:
            raise UsageError(f"a record payload holds at most "
                             f"{self.record_bytes - RECORD_HEADER_BYTES} bytes, got {nbytes}",
                             argument="nbytes")
        rec, pack, gather = self._rec_mv, _RECORD_HEADER.pack, self._gather_records

        def run(seq: int, signature: int, payload: bytes | memoryview, deadline: float) -> bool:
            rec[RECORD_HEADER_BYTES:end] = payload
            head = pack(seq, signature)
            rec[:RECORD_HEADER_BYTES] = head
            return gather(head, deadline)
        return run

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
            raise UsageError(f"native_extremes takes 1 to {_EXTREMES_LANES} values, got {k}",
                             argument="values")
        check = np.empty(2 * _EXTREMES_LANES, dtype=np.int64)
        try:
            check[:k] = values
        except (OverflowError, TypeError, ValueError) as exc:
            raise UsageError(f"native_extremes values must be int64 integers: {exc}",
                             argument="values") from None
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

