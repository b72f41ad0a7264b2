"""The transport interface: ordered, checked byte messages between ranks.

Algorithms (``bitcoll.algorithms``) talk to this interface only; they never see sockets or MPI.
A transport moves *frames*: a fixed 40-byte header followed by ``length`` payload bytes (the
byte layout is in :mod:`bitcoll.transport.wire`; its names are re-exported here).

Contract every transport implements
-----------------------------------
* ``isend(peer, payload, header)`` starts sending ``header`` then ``payload`` to ``peer`` and
  returns a :class:`Request` at once. ``payload`` must stay alive and unmodified until the
  request completes. Frames to one peer leave in the order of the ``isend`` calls.
* ``irecv(peer, payload, header)`` posts a receive of the next frame from ``peer`` into the
  writable ``payload``; ``header`` is what this rank *expects*. Receives from one peer are
  matched to frames in posting order. When the frame's header differs from the expected one
  (another collective, sequence number, step, signature or length) the request fails with
  :class:`~bitcoll.errors.ProtocolError` and the transport is aborted.
* ``Request.wait(deadline)`` blocks until completion or until ``time.monotonic()`` passes
  ``deadline`` (then :class:`~bitcoll.errors.CommTimeoutError`). A lost peer gives
  :class:`~bitcoll.errors.PeerLostError`.
* ``abort(reason)`` fails every pending and future request on this rank and makes every peer
  fail promptly too (it is called by the communicator on any communication error).
* ``stats`` counts what was handed to / taken from the wire by this rank, headers included.
* Zero-length payloads are legal and still move a header.
* Optionally (``streams``), ``stream(out_peer, in_peer, plan, deadline)`` runs a whole
  :class:`StreamPlan` (the frames of a ring pass, to one peer and from another) at once; the
  frames on the wire are exactly those of the ``isend``/``irecv`` calls it stands for.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from ..errors import CommError, UsageError
from .wire import HEADER_SIZE, MAGIC, PROTOCOL_VERSION, FrameHeader, FrameKind

__all__ = [
    "MAGIC",
    "PROTOCOL_VERSION",
    "HEADER_SIZE",
    "FrameKind",
    "FrameHeader",
    "Request",
    "Consumer",
    "StreamPlan",
    "TrafficStats",
    "Transport",
    "NativeCollectives",
    "byte_view",
    "format_bytes",
]


def format_bytes(n: float) -> str:
    """``n`` bytes in decimal units for reports: ``"512 B"``, ``"1.5 kB"``, ``"2.0 GB"``."""
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


class TrafficStats:
    """Bytes and messages moved by one rank, headers included. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.bytes_sent = 0
        self.bytes_received = 0
        self.messages_sent = 0
        self.messages_received = 0

    def add_sent(self, nbytes: int, messages: int = 1) -> None:
        with self._lock:
            self.bytes_sent += nbytes
            self.messages_sent += messages

    def add_received(self, nbytes: int, messages: int = 1) -> None:
        with self._lock:
            self.bytes_received += nbytes
            self.messages_received += messages

    def snapshot(self) -> dict[str, int]:
        """Return the four counters as a dict."""
        with self._lock:
            return {
                "bytes_sent": self.bytes_sent,
                "bytes_received": self.bytes_received,
                "messages_sent": self.messages_sent,
                "messages_received": self.messages_received,
            }

    def reset(self) -> None:
        """Set every counter to zero."""
        with self._lock:
            self.bytes_sent = self.bytes_received = 0
            self.messages_sent = self.messages_received = 0

    def __repr__(self) -> str:
        return f"TrafficStats({self.snapshot()})"

    def __str__(self) -> str:
        s = self.snapshot()
        return (f"sent {format_bytes(s['bytes_sent'])} in {s['messages_sent']} messages, "
                f"received {format_bytes(s['bytes_received'])} in "
                f"{s['messages_received']} messages")


class Request(ABC):
    """A pending send or receive."""

    @abstractmethod
    def done(self) -> bool:
        """Return True once the request completed (successfully or not); never blocks."""

    @abstractmethod
    def wait(self, deadline: float) -> None:
        """Block until completion; raise CommError (CommTimeoutError past ``deadline``,
        a ``time.monotonic()`` value)."""


Consumer = Callable[[int, memoryview], None]
"""``consume(offset, chunk)``: a piece of a frame's payload starting at byte ``offset``."""


class StreamPlan:
    """The frames one rank exchanges in a ring pass, for :meth:`Transport.stream`.

    ``work`` and ``src`` are 1-D C-contiguous arrays of one dtype (the same object when in place).
    ``sends``: ``(header, start, stop, from_src, after)`` per frame, in order: elements ``[start,
    stop)`` of ``src`` (``from_src``) or ``work``: sent at once where ``after`` is -1, else a
    forward of receive number ``after`` (the same elements, of ``work``) whose bytes may leave as
    soon as that receive has made them final. ``recvs``: ``(header, start, stop, mode)`` per frame,
    in order, with the expected header: the payload lands in ``work[start:stop]`` (``mode`` 0), or
    is folded as ``work = src op payload`` (1), then divided by ``divisor`` (2: an average, at the
    block's owner). ``op`` is "sum", "max" or "min"."""

    __slots__ = ("divisor", "op", "recvs", "sends", "src", "work")

    def __init__(self, work: npt.NDArray[Any], src: npt.NDArray[Any], op: str, divisor: int,
                 sends: list[tuple[FrameHeader, int, int, bool, int]],
                 recvs: list[tuple[FrameHeader, int, int, int]]) -> None:
        self.work = work
        self.src = src
        self.op = op
        self.divisor = divisor
        self.sends = sends
        self.recvs = recvs


class Transport(ABC):
    """Ordered, header-checked frames between the ``size`` ranks of one job."""

    name: str = "abstract"
    rank: int
    size: int
    stats: TrafficStats
    #: Bytes one frame adds to its payload in :attr:`stats` (its header, and on the TCP
    #: transport the checksum or integrity tag after the payload): a frame of ``n`` payload
    #: bytes counts ``n + frame_overhead``.
    frame_overhead: int = HEADER_SIZE
    #: The name of the collective this rank is running (set by the communicator as each
    #: starts): a frame of another call is reported as a mismatch of that collective, in the
    #: form every backend uses (:func:`bitcoll.arguments.mismatch_text`), also in the abort
    #: reason the peers receive.
    collective: str | None = None

    @abstractmethod
    def isend(self, peer: int, payload: memoryview, header: FrameHeader) -> Request:
        """Start sending ``header`` + ``payload`` (a C-contiguous byte view) to ``peer``."""

    @abstractmethod
    def irecv(self, peer: int, payload: memoryview, header: FrameHeader) -> Request:
        """Post a receive of the next frame from ``peer`` into the writable byte view
        ``payload``; ``header`` is the expected header."""

    #: True when :meth:`irecv_consume` is available: the payload is handed to the caller
    #: piece by piece as it arrives, so a reduction can read it while it is in the CPU cache.
    consumes_on_receive: bool = False

    def irecv_consume(self, peer: int, nbytes: int, header: FrameHeader,
                      consume: Consumer) -> Request:
        """Post a receive of the next frame from ``peer`` (``nbytes`` of payload) whose payload
        is passed to ``consume(offset, chunk)`` in order, in chunks whose sizes are multiples
        of 8 bytes except possibly the last (``chunk`` is only valid during the call). Called
        on a transport thread; an exception from ``consume`` fails the request and aborts the
        transport. Only when :attr:`consumes_on_receive`; UsageError elsewhere."""
        raise UsageError(f"the {self.name} transport cannot hand a payload over as it arrives "
                         "(consumes_on_receive is False)")

    #: True when :meth:`stream` can run a :class:`StreamPlan` (it may still decline one).
    streams: bool = False

    def stream_folds(self, dtype: np.dtype[Any], op: str) -> bool:
        """Whether :meth:`stream` folds frames of ``dtype`` with ``op`` ("sum", "max" or
        "min"), to the same bits as the frame path's numpy fold. Only where :attr:`streams`
        is True."""
        return False

    def stream(self, out_peer: int, in_peer: int, plan: StreamPlan, deadline: float) -> bool:
        """Run ``plan``: its sends to ``out_peer`` and receives from ``in_peer`` (the same rank
        when there are two), frame for frame what the equivalent ``isend``/``irecv`` calls
        would put on the wire, on the calling thread, until every frame is done or
        ``deadline`` (a ``time.monotonic()`` value) passes. Returns False, having sent and
        received nothing, when it cannot run it now (the caller then makes the calls
        itself); raises like ``Request.wait``, and a failure aborts the transport as there.
        Only where :attr:`streams` is True."""
        return False

    def subgroup(self, members: list[int], tag: str, timeout: float) -> Transport:
        """A new transport over the ranks ``members`` of this one (sorted in the new rank
        order; this rank among them), whose traffic never mixes with this transport's or a
        sibling group's. Collective over ``members``; ``tag`` is the same on every member and
        unique among this transport's groups; ``timeout`` (seconds) bounds the set-up."""
        raise UsageError(f"the {self.name} transport cannot make sub-groups")

    @abstractmethod
    def abort(self, reason: str) -> None:
        """Fail all pending and future requests here and make every peer fail promptly."""

    @abstractmethod
    def close(self) -> None:
        """Release sockets / communicators. Idempotent."""

    @property
    @abstractmethod
    def failure(self) -> CommError | None:
        """The error that aborted this transport, or None while it is healthy."""


@runtime_checkable
class NativeCollectives(Protocol):
    """A transport with collectives of its own (MPI's), behind ``algorithm="native"``.

    Arrays are C-contiguous numpy arrays; ``op`` is "sum", "max" or "min"; ``deadline`` is a
    ``time.monotonic()`` value (CommTimeoutError past it). A dtype the library cannot reduce
    is a UsageError before anything is sent (:meth:`reducible` says so without raising).
    These collectives carry no frame headers: callers check that every rank passes the same
    arguments first, with :meth:`exchange_records`, whose message has a fixed size (and
    :meth:`native_extremes` to find out which argument differs).
    """

    record_bytes: int
    """Bytes of one rank's record in :meth:`exchange_records` (header included)."""

    record_payloads: npt.NDArray[np.uint8]
    """The ``(size, record_bytes - 16)`` payloads :meth:`exchange_records` returns: one
    array, refilled by each exchange (views of it stay valid)."""

    def exchange_records(self, seq: int, signature: int, payload: memoryview | None,
                         deadline: float) -> tuple[bool, npt.NDArray[np.uint8]]:
        """One all-gather of a fixed-size record per rank: ``(agree, payloads)``, ``agree``
        when every rank passed the same ``seq`` and ``signature``, row r of ``payloads``
        starting with rank r's ``payload`` (at most ``record_bytes - 16`` bytes)."""

    def prepared_records(self, nbytes: int
                         ) -> Callable[[int, int, bytes | memoryview, float], bool]:
        """:meth:`exchange_records` for payloads of exactly ``nbytes`` bytes, checked once:
        ``run(seq, signature, payload, deadline)`` returns ``agree``; the payloads are then
        in :attr:`record_payloads`."""

    def reducible(self, dtype: np.dtype[Any], op: str) -> bool:
        """Whether :meth:`native_allreduce` reduces ``dtype`` with ``op``."""

    def native_extremes(self, values: Sequence[int], deadline: float
                        ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """``(hi, lo)``: the largest and smallest of each of ``values`` over the ranks."""

    def native_allreduce(self, send: npt.NDArray[Any], recv: npt.NDArray[Any], op: str,
                         deadline: float) -> None:
        """``recv = op(send of every rank)`` (``recv`` may be ``send``: in place)."""

    def prepared_allreduce(self, dtype: np.dtype[Any], op: str
                           ) -> Callable[[npt.NDArray[Any], npt.NDArray[Any], float], None]:
        """:meth:`native_allreduce` of ``dtype`` with ``op``, its checks done once:
        ``run(send, recv, deadline)`` for callers that guarantee on every call that ``send``
        and ``recv`` are C-contiguous numpy arrays of ``dtype`` and one size, ``recv``
        writable, and either the same array or not overlapping. UsageError now when
        :meth:`reducible` is False."""

    def prepared_checked_allreduce(self, dtype: np.dtype[Any], count: int, op: str
                                   ) -> Callable[[int, int, npt.NDArray[Any], npt.NDArray[Any],
                                                  float], bool]:
        """The argument check then MPI's all-reduce of ``count`` elements of ``dtype`` with
        ``op``, prepared once: ``run(seq, signature, send, recv, deadline)`` returns False,
        having reduced nothing, when the records disagree, else reduces ``send`` into ``recv``
        (arrays as :meth:`prepared_allreduce` requires; ``recv is send``: in place) and
        returns True. UsageError now when :meth:`reducible` is False."""

    def native_reduce_scatter(self, send: npt.NDArray[Any], recv: npt.NDArray[Any],
                              counts: list[int], op: str, deadline: float) -> None:
        """Rank r receives block r (``counts[r]`` elements) of ``op(send of every rank)``."""

    def native_allgather(self, send: npt.NDArray[Any], recv: npt.NDArray[Any],
                         deadline: float) -> None:
        """``recv`` = the ``send`` arrays of ranks 0..size-1, concatenated."""

    def native_bcast(self, buf: npt.NDArray[Any], root: int, deadline: float) -> None:
        """``buf`` of ``root`` into ``buf`` of every rank."""

    def native_alltoall(self, send: npt.NDArray[Any], recv: npt.NDArray[Any],
                        deadline: float) -> None:
        """Block j of ``send`` to rank j; block i of ``recv`` from rank i."""

    def native_barrier(self, deadline: float) -> None:
        """Returns once every rank has entered."""


def byte_view(buf: object, *, writable: bool, what: str) -> memoryview:
    """Return ``buf`` as a flat unsigned-byte memoryview (no copy); UsageError if impossible."""
    try:
        mv = memoryview(buf)  # type: ignore[arg-type]  # any buffer-protocol object
    except TypeError as exc:
        raise UsageError(f"{what} must support the buffer protocol, got {type(buf)!r}") from exc
    if writable and mv.readonly:
        raise UsageError(f"{what} must be writable")
    if not mv.c_contiguous:
        raise UsageError(f"{what} must be C-contiguous")
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv
