"""The MPI transport's frame messages: tags, sizes, the wait loop's back-off, the frame
checks and the request objects (see :mod:`bitcoll.transport.mpi.transport`, "Wire format" and
"Waiting").
"""

from __future__ import annotations

import contextlib
import os
import time
from abc import abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Final

import numpy as np
import numpy.typing as npt

from ...errors import CommError, CommTimeoutError, ProtocolError
from ..base import HEADER_SIZE, FrameHeader, Request
from ..netio import Backoff
from ..peer import OVERSUBSCRIBED_SPIN_SECONDS, SPIN_SECONDS

if TYPE_CHECKING:
    from mpi4py import MPI

    from .transport import MPITransport

__all__ = ["DATA_TAG", "CONTROL_TAG", "INLINE_MAX", "CONTROL_SIZE"]

DATA_TAG: Final = 1
"""MPI tag of frame messages on the transport's private communicator."""

CONTROL_TAG: Final = 2
"""MPI tag of abort notices on the transport's private communicator."""

INLINE_MAX: Final = 8192
"""Largest payload (bytes) that travels in the same MPI message as its header."""

CONTROL_SIZE: Final = 512
"""Size in bytes of an abort notice: a 40-byte header and up to 472 bytes of UTF-8 reason."""

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

