"""The per-peer machinery every frame transport with its own connections shares.

:class:`~bitcoll.transport.tcp.TCPTransport` (one socket per peer) and the shared-memory side
of :class:`~bitcoll.transport.shm.HybridTransport` (one pair of rings per peer) keep each
peer in a :class:`PeerLink`: its lifecycle state, its send queue and its posted receives, with
one routine that fails everything queued. Their requests are :class:`FrameRequest`.

Lifecycle (:class:`PeerState`), changed only by :meth:`PeerLink.transition` with the link's
``lock`` held::

    OPEN ──► PEER_CLOSED ──► FAILED ──► CLOSED
      │                        ▲          ▲
      └────────────────────────┴──────────┘

* ``OPEN``: frames flow.
* ``PEER_CLOSED``: the peer closed its end cleanly between frames while nothing was posted
  from it (it closed its transport); the next ``isend``/``irecv`` involving it fails the
  transport.
* ``FAILED``: the transport failed (its one failure path): every request of the peer has
  failed.
* ``CLOSED``: the transport was closed.

Progress
--------
Receives progress on the thread that waits for them: whoever holds a link's *reader token*
(``rx``) reads from the peer and completes posted receives in posting order. A receive large
enough to be worth overlapping with the caller's work (:data:`HELPER_RECEIVE_BYTES`, plain or
consumed piece by piece) is marked ``helper`` and served by the link's receiver thread
instead, woken through ``helper_q``. A caller about to block on
something it does not drive itself (a send still being written, a receive a helper serves)
first hands every posted receive to the helpers (``helper_q``), so that no two ranks can wait
on each other's unread data. Sends that do not fit at once go to the link's sender thread
through ``send_q``, in order.

Failure
-------
A transport fails once, through its one failure path (``_fail``). Transports that fail
together share one :class:`FailureRecord`: a :class:`~bitcoll.transport.shm.HybridTransport`
and the TCP transport it wraps. The first error any of them records is the ``failure`` of
each (the same object), and each tells its own peers (abort notices, links failed, threads
woken): a failure that starts on one path reaches the peers of the other at once, and every
rank reports the one cause.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import os
import queue
import threading
import time
from abc import abstractmethod
from collections.abc import Callable
from typing import Any, Final, Generic, TypeVar

from ..errors import BitcollError, CommError, CommTimeoutError, UsageError
from .base import Consumer, FrameHeader, Request, Transport, byte_view

__all__ = ["PeerState", "ALLOWED", "Want", "FrameRequest", "PeerLink", "LinkTransport",
           "ConsumerFailed", "FailureRecord",
           "timeout_error", "HELPER_RECEIVE_BYTES", "SPIN_SECONDS",
           "OVERSUBSCRIBED_SPIN_SECONDS"]

#: Receives of at least this many payload bytes are served by the link's receiver thread
#: (overlap with the caller's work); smaller ones by the thread that waits for them.
HELPER_RECEIVE_BYTES: Final = 256 << 10
#: How long a caller looks for its frame without sleeping before it blocks in ``poll`` (a
#: reply to a small frame usually comes within microseconds; waking from poll costs a
#: reschedule).
SPIN_SECONDS: Final = 50e-6
#: The same where more ranks share the host than this process has cores (an oversubscribed
#: host): spinning then only keeps the awaited rank off the core, so waiters look for this
#: long only, calling ``sched_yield`` between looks.
OVERSUBSCRIBED_SPIN_SECONDS: Final = 10e-6


class PeerState(enum.Enum):
    """Lifecycle of one peer link (see the module docstring)."""

    OPEN = "open"
    PEER_CLOSED = "peer closed"
    FAILED = "failed"
    CLOSED = "closed"


#: The transitions :meth:`PeerLink.transition` allows.
ALLOWED: Final[dict[PeerState, frozenset[PeerState]]] = {
    PeerState.OPEN: frozenset({PeerState.PEER_CLOSED, PeerState.FAILED, PeerState.CLOSED}),
    PeerState.PEER_CLOSED: frozenset({PeerState.FAILED, PeerState.CLOSED}),
    PeerState.FAILED: frozenset({PeerState.CLOSED}),
    PeerState.CLOSED: frozenset(),
}


class Want(enum.Enum):
    """What advancing a link's receive side needs before it can go on."""

    READ = 1  # more bytes from the peer
    IDLE = 2  # a receive to be posted (or the link is no longer open)
    HELPER = 3  # the next receive is the receiver thread's


class ConsumerFailed(Exception):
    """A consumer of ``irecv_consume`` raised; the transport has failed
    (:meth:`LinkTransport._consume_piece`)."""


class FrameRequest(Request):
    """A pending send or receive of one frame to or from ``peer``, on ``owner``.

    Completion is signalled by releasing a lock taken at creation (cheaper than an Event: one
    C call on each side). :meth:`wait` first makes progress on the calling thread (a receive:
    ``owner._drive``; a send: ``owner.hand_over``), then blocks on the lock until the
    deadline (``owner._timeout_for`` past it).
    """

    __slots__ = ("_done", "_error", "_lock", "_owner", "consume", "header", "helper",
                 "is_send", "peer", "posted", "view")

    def __init__(self, owner: LinkTransport, peer: int, header: FrameHeader, view: memoryview,
                 is_send: bool) -> None:
        self._owner = owner
        self._lock = threading.Lock()
        self._lock.acquire()
        self._done = False
        self._error: BitcollError | None = None
        self.peer = peer
        self.header = header
        self.view = view  # the payload (unsigned bytes)
        self.is_send = is_send
        self.posted = time.monotonic()
        self.consume: Consumer | None = None  # irecv_consume: the payload goes here
        self.helper = False  # a receive served by the link's receiver thread

    def _finish(self, error: BitcollError | None) -> None:
        """Complete the request (first call wins); wakes its waiter."""
        if self._done:
            return
        self._error = error
        self._done = True
        with contextlib.suppress(RuntimeError):  # a concurrent _finish released it already
            self._lock.release()

    def done(self) -> bool:
        return self._done

    def block(self, timeout: float) -> bool:
        """Block up to ``timeout`` seconds for completion; whether it completed."""
        if self._done:
            return True
        if timeout <= 0 or not self._lock.acquire(timeout=min(timeout, threading.TIMEOUT_MAX)):
            return self._done
        self._lock.release()
        return True

    def wait(self, deadline: float) -> None:
        if not self._done:
            if self.is_send:
                self._owner.hand_over()
            else:
                self._owner._drive(self, deadline)
            if not self.block(deadline - time.monotonic()):
                raise self._owner._timeout_for(self)
        if self._error is not None:
            raise self._error.with_traceback(None)


R = TypeVar("R", bound=FrameRequest)


class PeerLink(Generic[R]):
    """One peer of a transport: its :class:`PeerState`, send side and receive side.

    Locks: ``lock`` guards ``state``, ``queued`` and appending to / removing from
    ``posted``; ``send_lock`` is held while a frame is being written; ``rx`` (the reader
    token) is held by whoever reads from the peer.
    """

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.state = PeerState.OPEN
        self.lock = threading.Lock()
        # send side
        self.send_q: queue.SimpleQueue[R | None] = queue.SimpleQueue()
        self.send_lock = threading.Lock()
        self.queued = 0  # sends handed to the sender thread and not finished by it
        # receive side
        self.posted: collections.deque[R] = collections.deque()
        self.rx = threading.Lock()
        self.helper_q: queue.SimpleQueue[bool | None] = queue.SimpleQueue()
        self.sender: threading.Thread | None = None
        self.receiver: threading.Thread | None = None

    def transition(self, new: PeerState) -> bool:
        """Move to ``new`` if :data:`ALLOWED` permits it; return whether it moved.
        Precondition: the caller holds ``lock``. The only place ``state`` changes."""
        assert self.lock.locked()
        if new not in ALLOWED[self.state]:
            return False
        self.state = new
        return True

    def head(self) -> R | None:
        """The oldest posted receive (only the reader-token holder removes it)."""
        posted = self.posted
        return posted[0] if posted else None

    def pop(self, req: R) -> bool:
        """Remove ``req``, the oldest posted receive, once its frame is complete; False when
        the failure path has already taken it (and finished it)."""
        with self.lock:
            if not self.posted or self.posted[0] is not req:
                return False
            self.posted.popleft()
        return True

    def claim_send(self, inline: bool = True) -> bool:
        """Whether the caller writes its frame to this peer itself, now: ``inline`` allowed,
        nothing queued and nothing being written (order is kept: no frame is ahead of it);
        it then holds ``send_lock`` and must release it. Otherwise the frame counts as
        queued (``queued``) and the caller puts it on ``send_q``."""
        with self.lock:
            if inline and self.queued == 0 and self.send_lock.acquire(blocking=False):
                return True
            self.queued += 1
            return False

    def hand_over(self) -> None:
        """Give the posted receives to the receiver thread (the caller is about to block on
        something it does not drive)."""
        if self.posted and self.state is PeerState.OPEN:
            self.helper_q.put(True)

    def serve_handed(self, serve: Callable[[], None], busy: Callable[[], bool]) -> None:
        """The receiver thread's body: for every hand-over (``helper_q``), take the reader
        token and ``serve()`` the posted receives; again while receives are posted and
        ``busy()`` (the link is open and the transport healthy); return at a ``None``."""
        while self.helper_q.get() is not None:
            while True:
                with self.rx:
                    serve()
                # Look again after releasing the token: a receive posted while we held it may
                # have found the token taken.
                if not self.posted or not busy():
                    break

    def stop(self, state: PeerState, error: BitcollError, drain: bool = False) -> None:
        """Move to ``state`` (FAILED or CLOSED), fail every request with ``error`` and tell
        the receiver thread to exit (``drain``: to read and drop what the peer still
        sends, then wait for the next hand-over instead)."""
        with self.lock:
            self.transition(state)
        self.fail_requests(error)
        self.helper_q.put(True if drain else None)

    def fail_requests(self, error: BitcollError) -> None:
        """Fail every request posted or queued for this peer with ``error`` and stop the
        sender thread (a ``None`` on its queue)."""
        with self.lock:
            posted = list(self.posted)
            self.posted.clear()
        for r in posted:
            r._finish(error)
        while True:
            try:
                s = self.send_q.get_nowait()
            except queue.Empty:
                break
            if s is not None:
                with self.lock:
                    self.queued -= 1
                s._finish(error)
        self.send_q.put(None)


_LT = TypeVar("_LT", bound="LinkTransport")


class FailureRecord:
    """The one failure of the transports that fail together (module docstring, "Failure"):
    a transport, and the transports built over it that share its fate.

    ``lock`` guards ``error`` and every member's ``_failure``, ``_closed`` and ``_closing``;
    ``members`` are the transports in the order they joined (the wrapped one first)."""

    __slots__ = ("error", "lock", "members")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.error: CommError | None = None
        self.members: list[LinkTransport] = []


class LinkTransport(Transport):
    """Base of the transports that keep a :class:`PeerLink` per peer: the failure record
    (shared with the transports that fail together with this one), the close flags, the
    wake-up pipe every waiting thread polls, the links' threads (the sender loop, over
    :meth:`_write_queued`), the checks every ``isend``/``irecv`` makes, the start of a posted
    receive, :meth:`progress`, :meth:`hand_over`, and the calls a :class:`FrameRequest` makes
    while it waits."""

    _failures: FailureRecord
    #: The links (:class:`PeerLink`), in the order every loop over them takes.
    _links: list[Any]

    def _init_links(self, pipe: bool, fails_with: LinkTransport | None = None) -> None:
        """Set up the shared state (``pipe``: whether threads will poll the wake pipe).
        ``fails_with``: a transport this one wraps; the two then share one
        :class:`FailureRecord` (a failure already recorded there is this one's too)."""
        record = FailureRecord() if fails_with is None else fails_with._failures
        self._failures = record
        self._lock = record.lock  # guards _failure, _closed, _closing (of every member)
        self._closed = False  # close() began: queued sends are flushed, nothing new starts
        self._closing = False  # the links are being shut down: their errors are expected
        with record.lock:
            self._failure: CommError | None = record.error
            record.members.append(self)
        # A byte written here wakes every thread polling (failure, close); it stays, so that
        # every later poll returns at once too.
        self._wake_r, self._wake_w = (os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC) if pipe
                                      else (-1, -1))

    def _start_links(self, links: list[Any], kind: str) -> None:
        """Keep ``links`` (:attr:`_links`) and start each one's sender thread
        (:meth:`_send_loop`) and receiver thread (:meth:`_helper_loop`), named after
        ``kind`` ("tcp", "shm")."""
        self._links = links
        for p in links:
            p.sender = threading.Thread(target=self._send_loop, args=(p,), daemon=True,
                                        name=f"bitcoll-{kind}-send-{self.rank}-to-{p.rank}")
            p.receiver = threading.Thread(
                target=self._helper_loop, args=(p,), daemon=True,
                name=f"bitcoll-{kind}-recv-{self.rank}-from-{p.rank}")
            p.sender.start()
            p.receiver.start()

    @property
    def failure(self) -> CommError | None:
        """The error that aborted this transport, or None while it is healthy."""
        return self._failure

    def _check_open(self) -> None:
        """Raise UsageError once the transport is closed, its failure once it failed."""
        if self._closed:
            raise UsageError(f"the {self.name.upper()} transport is closed")
        failure = self._failure
        if failure is not None:
            raise failure.with_traceback(None)

    @staticmethod
    def _check_length(header: FrameHeader, nbytes: int) -> None:
        """UsageError (``argument`` "payload") unless ``header.length`` is ``nbytes``."""
        if header.length != nbytes:
            raise UsageError(f"header.length is {header.length} but the payload has "
                             f"{nbytes} bytes", argument="payload")

    @classmethod
    def _payload(cls, payload: memoryview, header: FrameHeader, writable: bool) -> memoryview:
        """``payload`` as a flat byte view of ``header.length`` bytes (UsageError if not)."""
        mv = byte_view(payload, writable=writable, what="payload")
        cls._check_length(header, mv.nbytes)
        return mv

    def _send_loop(self, p: Any) -> None:
        """The sender thread of link ``p``: finish the frames queued to it, in order
        (:meth:`_write_queued`); once the transport failed, fail them with its failure."""
        while True:
            req = p.send_q.get()
            if req is None:
                return
            with p.send_lock:
                error: BitcollError | None = self._failure
                if error is None:
                    error = self._write_queued(p, req)
                with p.lock:
                    p.queued -= 1
            req._finish(error)

    @abstractmethod
    def _write_queued(self, p: Any, req: Any) -> BitcollError | None:
        """Write the rest of the queued frame ``req`` to ``p`` (its send lock held; may
        block) and count it in :attr:`stats`; the error that ends it, or None."""

    @abstractmethod
    def _helper_loop(self, p: Any) -> None:
        """The receiver thread of link ``p`` (:meth:`PeerLink.serve_handed`)."""

    @abstractmethod
    def _advance(self, p: Any, blocking: bool) -> Want:
        """Complete the posted receives of ``p`` whose frames are there, in order; what it
        needs to go on. Precondition: the reader token ``p.rx`` is held."""

    def _read_if_free(self, p: Any) -> Want | None:
        """:meth:`_advance` ``p`` without blocking unless another thread holds its reader
        token (then None)."""
        if not p.rx.acquire(blocking=False):
            return None
        try:
            return self._advance(p, blocking=False)
        finally:
            p.rx.release()

    def _start_receive(self, p: Any, req: FrameRequest) -> None:
        """``req`` was just posted on ``p``: wake the receiver thread for a ``helper``
        receive, else take what has arrived already (the peer often sent first: the frame
        may be complete before anybody waits for it); fail it at once when the transport
        failed meanwhile."""
        if req.helper:
            p.helper_q.put(True)
        else:
            self._read_if_free(p)
        self._fail_late(p)

    def _fail_late(self, p: Any) -> None:
        """A request was just queued or posted on ``p``: when the transport has failed
        (perhaps before the request was there for the failure path to fail), fail it."""
        failure = self._failure
        if failure is not None:
            p.fail_requests(failure)

    def progress(self) -> None:
        """Read, without blocking, what has arrived on every open link no other thread is
        reading: frames of posted receives complete, an abort notice or a lost peer fails
        the transport (on TCP a clean close moves the peer to ``PEER_CLOSED``). Collectives
        do this themselves while they wait; this is for a caller that is between them.
        Never raises (look at :attr:`failure`)."""
        for p in self._links:
            if p.state is PeerState.OPEN:
                self._read_if_free(p)

    def _record_failure(self, error: CommError) -> list[LinkTransport]:
        """Record ``error`` as the failure of every transport sharing this one's record and
        not closed, unless a failure is recorded or this transport closed. Returns the
        transports that failed now (the outermost first), which must tell their peers;
        empty when nothing was recorded."""
        record = self._failures
        with record.lock:
            if record.error is not None or self._closed:
                return []
            record.error = error
            failed = [m for m in reversed(record.members) if not m._closed]
            for m in failed:
                m._failure = error
        return failed

    def _begin_close(self, timeout: float | None, default: float) -> float | None:
        """Mark the transport closed; the close deadline (``timeout`` or ``default``
        seconds from now), or None when it was closed already."""
        with self._lock:
            if self._closed:
                return None
            self._closed = True
        return time.monotonic() + (default if timeout is None else timeout)

    def _consume_piece(self, peer: int, consume: Consumer, pos: int,
                       chunk: memoryview) -> None:
        """Hand ``chunk`` (payload bytes from ``pos`` of a frame from ``peer``) to
        ``consume``. An exception from the consumer is a local failure: the transport fails
        with CommError (and so every request), then ConsumerFailed is raised."""
        try:
            consume(pos, chunk)
        except Exception as exc:
            self._fail(CommError(f"rank {self.rank}: consuming a frame from rank {peer} "
                                 f"failed: {type(exc).__name__}: {exc}",
                                 rank=self.rank, peer=peer))
            raise ConsumerFailed from exc

    def _fail(self, error: CommError, reason: str | None = None) -> None:
        """The one failure path: record ``error`` (the first failure wins, see
        :class:`FailureRecord`), then every transport that failed with it tells its peers
        ``reason`` (default: the error's text), fails its links and wakes its threads.
        Never raises."""
        failed = self._record_failure(error)
        if not failed:
            return
        text = str(error) if reason is None else reason
        for t in failed:
            t._spread_failure(error, text)

    @abstractmethod
    def _spread_failure(self, error: CommError, reason: str) -> None:
        """``error`` was just recorded (once): tell this transport's peers ``reason``, move
        its links to FAILED (failing their requests with ``error``) and wake its waiting
        threads. Never raises."""

    def abort(self, reason: str) -> None:
        """Fail every pending and future request here and make every peer fail promptly.

        On this rank ``failure`` becomes ``CommError("rank <r> aborted: <reason>")`` unless an
        earlier error is recorded (that one is kept); peers fail with
        ``PeerLostError("rank <r> aborted: <reason>")``. Idempotent; never raises; a no-op
        after close.
        """
        self._fail(CommError(f"rank {self.rank} aborted: {reason}", rank=self.rank), reason)

    def _wake(self) -> None:
        """Wake every thread polling the wake pipe."""
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"!")

    def _close_links(self, links: list[Any], deadline: float, shut: Callable[[Any], None],
                     release: Callable[[Any], None]) -> None:
        """The common part of ``close()``: let each link's sender thread finish the frames
        queued before now (until ``deadline``), then shut the links down (``shut(link)``),
        fail what is still pending with UsageError, join the threads, ``release(link)``
        and close the wake pipe."""
        closed = UsageError(f"the {self.name.upper()} transport is closed")
        for p in links:
            p.send_q.put(None)  # senders exit after the frames queued before it
        for p in links:
            if p.sender is not None:
                p.sender.join(max(0.0, deadline - time.monotonic()))
        self._closing = True
        for p in links:
            shut(p)
            p.stop(PeerState.CLOSED, closed)
        self._wake()
        for p in links:
            for t in (p.sender, p.receiver):
                if t is not None:
                    t.join(5.0)
            p.fail_requests(closed)
            release(p)
        self._close_wake_pipe()

    def _close_wake_pipe(self) -> None:
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)

    def hand_over(self) -> None:
        """The calling thread is about to block on something it does not drive: give every
        posted receive to its link's receiver thread."""
        self._hand_over_links()

    def _hand_over_links(self, but: Any = None) -> None:
        """:meth:`hand_over` for this transport's own links (but ``but``)."""
        for p in self._links:
            if p is not but:
                p.hand_over()

    @abstractmethod
    def _drive(self, req: Any, deadline: float) -> None:
        """Make progress on the calling thread until the receive ``req`` completes, the
        transport fails or ``deadline`` passes (or return early when a helper serves it)."""

    @abstractmethod
    def _timeout_for(self, req: Any) -> CommTimeoutError:
        """The error of a wait on ``req`` that passed its deadline."""

    def __enter__(self: _LT) -> _LT:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def timeout_error(rank: int, req: FrameRequest, silent: int,
                  where: str = "") -> CommTimeoutError:
    """The CommTimeoutError of ``req`` on ``rank``: what it was, how long it waited, and the
    rank the silence started from (``silent``, see ``TCPTransport.silent_origin``).
    ``where``: words on the path, e.g. ``"; shared memory"``."""
    h = req.header
    peer = req.peer
    what = f"send to rank {peer}" if req.is_send else f"receive from rank {peer}"
    waited = time.monotonic() - req.posted
    why = "" if silent == peer else (
        f"; rank {peer} was itself waiting: rank {silent} is the one that went silent")
    return CommTimeoutError(
        f"rank {rank}: {what} (collective #{h.seq}, step {h.step}, {h.length} bytes) did not "
        f"complete before the deadline ({waited:.3g} s after it was posted{where}){why}",
        rank=rank, peer=peer, sequence=h.seq, silent=silent)
