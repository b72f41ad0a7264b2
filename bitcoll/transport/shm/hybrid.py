"""The TCP backend with shared memory between the ranks of one host.

:class:`HybridTransport` wraps a connected :class:`~bitcoll.transport.tcp.TCPTransport`:
frames to a peer on this rank's host go through a shared-memory ring
(:mod:`bitcoll.transport.shm.channel`), frames to every other peer through the TCP transport
unchanged. ``bitcoll.init`` builds it (:func:`bitcoll.bootstrap.share_hosts`) when some rank
shares this rank's host (the host keys of :mod:`bitcoll.topology`) unless ``shm=False`` or
``BITCOLL_SHM=0`` (the ranks of a host must agree); the algorithms do not change. Its ``name``
stays ``"tcp"`` (``comm.backend``); ``comm.split`` gives sub-communicators the same treatment.

Contract (that of :class:`~bitcoll.transport.base.Transport`, kept per peer)
--------------------------------------------------------------------------
* Each peer uses one path for the transport's whole life, so frames to one peer leave in
  ``isend`` order and receives from one peer match frames in posting order, whatever the path.
* A shared-memory frame is the same 40-byte header and payload as on TCP (in the ring: plus
  an 8-byte record word and up to 7 bytes of padding, not counted); the receiver checks the
  header exactly like TCP: a mismatch is a :class:`~bitcoll.errors.ProtocolError` and aborts
  the transport (a :class:`~bitcoll.errors.PeerLostError` with the peer's reason when the
  peer aborted: the frame is then one of the collective it abandoned; its abort is waited
  for up to :data:`MISMATCH_GRACE_SECONDS`).
* ``stats`` counts ``HEADER_SIZE + payload`` bytes and one message per frame on both paths (a
  send when its last byte is in the ring or, single copy, when the receiver has copied it; a
  receive when complete). ``stats_local`` counts the shared-memory frames alone and
  ``stats_remote`` (the TCP transport's own ``stats``) the TCP frames; ``stats`` is their sum
  and ``stats.reset()`` resets both. Integrity tags
  (``integrity=True``) are only on TCP frames: shared memory never leaves the host and only
  this user can map it.
* ``irecv_consume`` hands the consumer pieces (multiples of 8 bytes except the last) of at
  most :data:`~bitcoll.transport.shm.CHUNK_BYTES`, views of the ring itself, or for a
  single-copy frame of at most :data:`~bitcoll.transport.shm.SINGLE_COPY_CONSUME_BYTES`, views
  of a per-peer bounce buffer (cache-sized), so a ring reduction reads the peer's bytes
  without a landing buffer.

Data path
---------
Every shared-memory peer is a :class:`~bitcoll.transport.peer.PeerLink`, like a TCP
connection: the same lifecycle (:class:`~bitcoll.transport.peer.PeerState`: ``OPEN`` until
the transport fails or closes; a peer's exit is seen by whoever waits on it, so
``PEER_CLOSED`` is TCP's only), the same send queue and posted receives, the same reader token
and the same split between the calling thread and the helper threads:

* ``isend`` copies the record into the out ring right away when nothing is queued for that
  peer and it fits; the rest of a frame that does not fit (the ring is full, or the frame is
  larger than the ring) goes to the peer's *sender* thread, which copies it chunk by chunk,
  waiting on the "space" doorbell. A frame of at least
  :data:`~bitcoll.transport.shm.SINGLE_COPY_MIN_BYTES` to a peer that can read this process's
  memory goes as a single-copy record instead (only its address enters the ring; the sender
  thread waits for the receiver's acknowledgement): one copy instead of two.
* A receive smaller than :data:`~bitcoll.transport.peer.HELPER_RECEIVE_BYTES` whose record
  fits the ring is read by the thread that waits for it (``irecv`` already takes it when the
  record is there): it looks at the ring's counters without sleeping for
  :data:`~bitcoll.transport.peer.SPIN_SECONDS`, then blocks on the "data" doorbell, so an
  exchange of small frames wakes no other thread (an ``irecv_consume`` of that size is
  consumed there too, from the ring). Larger receives, plain or consumed, are served by the
  peer's *receiver* thread (overlap with the caller's work): it checks the header, then
  copies (or consumes) the payload as it is published,
  advancing the ring's ``read`` counter after every chunk so that the sender can stream a
  frame larger than the ring, or copies a single-copy payload out of the sender with
  ``process_vm_readv``. Large copies (numpy, ctypes) release the GIL.
* A caller about to block on something it does not drive (a send, a receive the receiver
  thread serves, a TCP request) first hands every posted receive of both paths to the
  receiver threads, so that no two ranks wait on each other's unread data.

Failure
-------
* :meth:`HybridTransport.abort` (and every internal failure) records the error, writes the
  reason into every shared segment (this side's abort state) and rings both doorbells of every
  shared-memory peer, wakes this rank's own waiting threads, and aborts the TCP transport (which
  tells the TCP peers and leaves the reason in the store). A shared-memory peer waiting on this
  rank fails at once with ``PeerLostError("rank <r> aborted: <reason>")``.
* A peer that exits, is killed or closes its transport closes its doorbell ends: a waiter
  sees end of file at once and, unless the bytes it waits for are already in the ring, fails
  with ``PeerLostError`` naming that rank (a peer that only closed between frames while
  nothing is posted from it fails nothing, as on TCP). A single-copy read from a process that
  is gone fails the same way.
* A failure of the TCP transport (a remote peer lost or aborted) fails this transport too:
  seen at once by a caller waiting on a TCP request, within :data:`~bitcoll.transport.shm.
  WATCH_SECONDS` by a thread waiting on a doorbell (a caller waiting there also reads the
  idle TCP connections then, so an abort notice from another host is seen).
* ``Request.wait`` past its deadline raises :class:`~bitcoll.errors.CommTimeoutError` naming
  the rank the silence started from (the TCP transport's store record,
  ``TCPTransport.silent_origin``) and leaves the transport as it is.
* After a failure every pending request fails with it and every ``isend``/``irecv`` raises it.

``close()`` lets queued sends finish (within the TCP transport's ``close_timeout``), stops the
threads, closes the doorbells, unmaps the segments and closes the TCP transport. The segments
were unlinked at set-up (:mod:`bitcoll.transport.shm`), so nothing is left in ``/dev/shm``
even when a rank is killed.

What this module reads of the TCP transport: its public ``rank``, ``size``, ``stats``,
``job_id``, ``close_timeout``, ``failure``, ``isend``/``irecv``/``irecv_consume``,
``abort``, ``close``, ``subgroup`` and ``silent_origin``; set-up frames travel on the TCP
connections themselves (sequence number :data:`SETUP_SEQ`), so segment names only ever cross
authenticated connections.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import struct
import time
import zlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Final, TypeVar

import numpy as np
import numpy.typing as npt

from ...config import switch
from ...errors import (
    BitcollError,
    CommError,
    CommTimeoutError,
    PeerLostError,
    ProtocolError,
    UsageError,
)
from ...topology import Topology
from ..base import (
    HEADER_SIZE,
    Consumer,
    FrameHeader,
    Request,
    StreamPlan,
    TrafficStats,
    Transport,
    byte_view,
)
from ..peer import (
    HELPER_RECEIVE_BYTES,
    OVERSUBSCRIBED_SPIN_SECONDS,
    SPIN_SECONDS,
    ConsumerFailed,
    FrameRequest,
    LinkTransport,
    PeerLink,
    PeerState,
    Want,
    timeout_error,
)
from . import channel as shm

if TYPE_CHECKING:
    from ..tcp import TCPTransport

__all__ = ["HybridTransport", "CombinedStats", "ENV_SHM", "DEFAULT_SHM", "shm_enabled",
           "SETUP_SEQ"]

#: Environment variable: "0" turns shared memory off, "1" on (default :data:`DEFAULT_SHM`).
ENV_SHM: Final = "BITCOLL_SHM"
#: Whether ``bitcoll.init`` uses shared memory when neither ``shm=`` nor ``BITCOLL_SHM`` say.
DEFAULT_SHM: Final = True
#: Sequence number of the set-up frames on the TCP connections (no collective has it).
SETUP_SEQ: Final = 2**64 - 2
_SETUP_SIG: Final = zlib.crc32(b"bitcoll shared-memory set-up")
_T = TypeVar("_T")
#: How long a receiver that found a mismatched header waits for the peer's abort reason.
MISMATCH_GRACE_SECONDS: Final = 0.2

_log = logging.getLogger("bitcoll.shm")


def shm_enabled(value: bool | None) -> bool:
    """The ``shm`` setting of ``bitcoll.init``: ``value`` when given, else ``BITCOLL_SHM``
    ("0" or "1"), else :data:`DEFAULT_SHM`. UsageError for anything else."""
    return switch(value, "shm", ENV_SHM, DEFAULT_SHM)


def _summed(key: str) -> Any:
    """A read-only counter property of :class:`CombinedStats`: the sum of its parts'."""

    def get(self: CombinedStats) -> int:
        return self._sum(key)

    def refuse(self: CombinedStats, value: int) -> None:
        raise AttributeError("CombinedStats is a sum of counters: reset() it, or count into "
                             "its parts")

    return property(get, refuse)


class CombinedStats(TrafficStats):
    """The sum of several :class:`TrafficStats` (``stats_local`` + ``stats_remote``).

    The counters are read-only sums; ``reset()`` resets every part; ``add_sent`` /
    ``add_received`` count into the first part."""

    def __init__(self, *parts: TrafficStats) -> None:  # no super().__init__: no own counters
        self._parts = parts

    def _sum(self, key: str) -> int:
        return sum(p.snapshot()[key] for p in self._parts)

    bytes_sent = _summed("bytes_sent")
    bytes_received = _summed("bytes_received")
    messages_sent = _summed("messages_sent")
    messages_received = _summed("messages_received")

    def add_sent(self, nbytes: int, messages: int = 1) -> None:
        self._parts[0].add_sent(nbytes, messages)

    def add_received(self, nbytes: int, messages: int = 1) -> None:
        self._parts[0].add_received(nbytes, messages)

    def snapshot(self) -> dict[str, int]:
        total = {"bytes_sent": 0, "bytes_received": 0, "messages_sent": 0,
                 "messages_received": 0}
        for p in self._parts:
            for k, v in p.snapshot().items():
                total[k] += v
        return total

    def reset(self) -> None:
        for p in self._parts:
            p.reset()


class _Stop(Exception):
    """A transport thread must stop serving: the transport failed or is closing."""


def _align8(n: int) -> int:
    return (n + 7) & ~7


# Every frame in a ring is a record: mode and padding (8 bytes), the 40-byte header, then
# the payload (inline) or the payload's address in the sender (single copy), then padding
# to a multiple of 8 bytes.
_RECORD: Final = struct.Struct("<II")
_ADDRESS: Final = struct.Struct("<Q")
_INLINE: Final = 1
_SINGLE: Final = 2
_PREFIX: Final = _RECORD.size + HEADER_SIZE  # 48 bytes before an inline payload
#: Copies of at least this many bytes use numpy (which releases the GIL), smaller ones a
#: memoryview (less overhead).
_NUMPY_COPY_BYTES: Final = 64 << 10


class _ShmRequest(FrameRequest):
    """A pending shared-memory send or receive (:class:`~bitcoll.transport.peer.
    FrameRequest`): ``wait`` of a receive reads the ring itself (:meth:`HybridTransport.
    _drive`), ``wait`` of a send first hands the posted receives to the receiver threads."""

    __slots__ = ("data", "head", "inline", "pos", "single", "total")

    def __init__(self, owner: HybridTransport, peer: int, header: FrameHeader,
                 view: memoryview, is_send: bool, single: bool = False) -> None:
        super().__init__(owner, peer, header, view, is_send)
        self.data = np.frombuffer(view, np.uint8) if len(view) else np.empty(0, np.uint8)
        #: A send whose payload the receiver copies out of this process (single copy).
        self.single = single
        # The ring record before the payload: mode, header (and the payload's address).
        head = b""
        if is_send:
            head = _RECORD.pack(_SINGLE if single else _INLINE, 0) + header.pack()
            if single:
                head += _ADDRESS.pack(int(self.data.ctypes.data))
        self.head = head
        self.inline = 0 if single else header.length  # payload bytes in the ring
        self.total = _align8(len(head) + self.inline)  # record bytes in the ring
        self.pos = 0  # record bytes already in the ring (sends)


class _Routed(Request):
    """A TCP request of the hybrid transport. Its failure needs no translation (the two
    share one failure record); before blocking on it, the posted shared-memory receives go
    to their receiver threads."""

    __slots__ = ("_inner", "_owner")

    def __init__(self, owner: HybridTransport, inner: Request) -> None:
        self._owner = owner
        self._inner = inner

    def done(self) -> bool:
        return self._inner.done()

    def wait(self, deadline: float) -> None:
        if not self._inner.done():
            # The TCP transport drives only its own connections while it waits: the
            # posted shared-memory receives go to their receiver threads.
            self._owner._hand_over_links()
        self._inner.wait(deadline)


class _Peer(PeerLink[_ShmRequest]):
    """One shared-memory peer: the shared :class:`~bitcoll.transport.peer.PeerLink` (state,
    send queue, posted receives, reader token, sender and receiver threads) and its
    channel. The reader-token holder owns ``bounce`` and ``poller``."""

    def __init__(self, ch: shm.ShmChannel) -> None:
        super().__init__(ch.peer)
        self.ch = ch
        self.bounce: npt.NDArray[np.uint8] | None = None  # single-copy consume buffer
        self.poller: select.poll | None = None  # the data bell and the wake pipe


class HybridTransport(LinkTransport):
    """TCP for peers on other hosts, shared memory for peers on this one. Build it with
    :meth:`create` over a connected TCP transport (which it then owns)."""

    name = "tcp"
    consumes_on_receive = True
    _links: list[_Peer]

    def __init__(self, tcp: TCPTransport, hosts: Sequence[int],
                 channels: dict[int, shm.ShmChannel], ring_bytes: int,
                 fallbacks: dict[int, str] | None = None, single_copy: bool = True,
                 single_copy_min_bytes: int = shm.SINGLE_COPY_MIN_BYTES) -> None:
        self.rank = tcp.rank
        self.size = tcp.size
        self.job_id = tcp.job_id
        self.close_timeout = tcp.close_timeout
        self.hosts = tuple(hosts)
        self.ring_bytes = ring_bytes
        #: Whether large frames may go by single copy (see :meth:`create`).
        self.single_copy = single_copy
        #: Smallest payload (bytes, at least 1) sent by single copy where it is possible.
        self.single_copy_min_bytes = max(1, single_copy_min_bytes)
        #: Peers on this host that use TCP after all, and why (set-up refused shared memory).
        self.fallbacks = dict(fallbacks or {})
        self._tcp = tcp
        #: Frames through shared memory only.
        self.stats_local = TrafficStats()
        #: Frames through TCP only (the TCP transport's own counters).
        self.stats_remote = tcp.stats
        self.stats = CombinedStats(self.stats_local, self.stats_remote)
        self._init_links(pipe=True, fails_with=tcp)  # one failure record with the TCP side
        #: More ranks on this host than this process has cores: waiters spin less and yield.
        self.oversubscribed = Topology(self.hosts, self.rank).oversubscribed
        self._spin = OVERSUBSCRIBED_SPIN_SECONDS if self.oversubscribed else SPIN_SECONDS
        self._peers: dict[int, _Peer] = {p: _Peer(ch) for p, ch in channels.items()}
        self._start_links(list(self._peers.values()), "shm")

    # ---------------------------------------------------------------- set-up

    @classmethod
    def create(cls, tcp: TCPTransport, hosts: Sequence[int], timeout: float,
               ring_bytes: int | None = None, single_copy: bool = True,
               single_copy_min_bytes: int = shm.SINGLE_COPY_MIN_BYTES) -> Transport:
        """Give the peers of ``tcp`` on this rank's host (``hosts[r]``: rank ``r``'s host,
        the same list on every rank) shared-memory channels; return the hybrid transport,
        or ``tcp`` itself when no peer shares this host or none could map a segment.

        Collective over the ranks of ``tcp``'s host (the others return at once). ``timeout``
        (seconds) bounds the exchange. A pair that cannot use shared memory uses TCP (see
        :mod:`bitcoll.transport.shm`). On an error (a peer lost during set-up, the deadline)
        the TCP transport is aborted, nothing is left in ``/dev/shm``, and the error is
        raised. ``ring_bytes``: bytes of each direction's ring (default
        :data:`~bitcoll.transport.shm.DEFAULT_RING_BYTES`). ``single_copy``: whether frames
        of at least ``single_copy_min_bytes`` payload bytes (default
        :data:`~bitcoll.transport.shm.SINGLE_COPY_MIN_BYTES`) go by single copy to the peers
        that can read this process's memory; a pair uses single copy only when both of its
        ranks allow it (False: every frame goes through the rings). Sub-groups
        (:meth:`subgroup`) keep these settings."""
        if ring_bytes is None:
            ring_bytes = shm.DEFAULT_RING_BYTES
        if len(hosts) != tcp.size:
            raise UsageError(f"hosts has {len(hosts)} entries for {tcp.size} ranks")
        if ring_bytes < 4096 or ring_bytes % 4096:
            raise UsageError(f"ring_bytes must be a multiple of 4096, got {ring_bytes}")
        if isinstance(single_copy_min_bytes, bool) or \
                not isinstance(single_copy_min_bytes, int) or single_copy_min_bytes < 0:
            raise UsageError("single_copy_min_bytes must be an integer >= 0, got "
                             f"{single_copy_min_bytes!r}")
        rank = tcp.rank
        local = [p for p in range(tcp.size) if p != rank and hosts[p] == hosts[rank]]
        if not local or not shm.supported():  # the same answer on every rank of a host
            return tcp
        deadline = time.monotonic() + timeout
        offers: dict[int, shm.Offer] = {}
        channels: dict[int, shm.ShmChannel] = {}
        fallbacks: dict[int, str] = {}
        keep: list[Any] = []  # buffers of the set-up frames, alive until sent / received
        sends: list[Request] = []
        try:
            # Side 0 (the lower rank) offers (step 0), side 1 answers (step 1), side 0
            # confirms (step 2): see bitcoll.transport.shm. Receives are posted in the order
            # of the frames.
            inbox: dict[tuple[int, int], tuple[Request, bytearray]] = {}
            for p in local:
                steps = (1,) if rank < p else (0, 2)
                for step in steps:
                    buf = bytearray({0: shm.OFFER_BYTES, 1: shm.ANSWER_BYTES,
                                     2: shm.CONFIRM_BYTES}[step])
                    inbox[p, step] = (tcp.irecv(p, memoryview(buf),
                                                _setup_header(step, len(buf))), buf)

            def send(p: int, step: int, message: bytes) -> None:
                keep.append(message)
                sends.append(tcp.isend(p, memoryview(message),
                                       _setup_header(step, len(message))))

            def take(p: int, step: int) -> bytes:
                req, buf = inbox[p, step]
                req.wait(deadline)
                return bytes(buf)

            def settle(p: int, ch: shm.ShmChannel | None, why: str, step: int,
                       reply: bytes) -> None:
                """Keep the pair's channel (or why it uses TCP) and send ``reply``."""
                if ch is None:
                    fallbacks[p] = why
                else:
                    channels[p] = ch
                send(p, step, reply)

            for p in local:
                if rank < p:
                    made = offers[p] = shm.offer(tcp.job_id, ring_bytes)
                    send(p, 0, made.message)
            for p in local:
                if p < rank:
                    probe = shm.Probe()  # read by side 0 before it confirms
                    keep.append(probe)
                    ch, answer, why = shm.accept(p, take(p, 0), probe, single_copy)
                    settle(p, ch, why, 1, answer)
            for p in local:
                if rank < p:
                    ch, confirmation, why = shm.finish_offer(offers.pop(p), p, take(p, 1),
                                                             single_copy)
                    settle(p, ch, why, 2, confirmation)
            for p in local:
                if p < rank:
                    shm.confirm(channels.get(p), take(p, 2))
            for s in sends:
                s.wait(deadline)
        except BaseException as exc:
            for made in offers.values():
                shm.discard_offer(made)
            for ch in channels.values():
                ch.close()
            tcp.abort(f"shared-memory set-up failed on rank {rank}: "
                      f"{type(exc).__name__}: {exc}")
            raise
        for p, why in fallbacks.items():
            _log.warning("rank %d: rank %d shares this host but uses TCP: %s", rank, p, why)
        if not channels:
            return tcp
        return cls(tcp, hosts, channels, ring_bytes, fallbacks, single_copy,
                   single_copy_min_bytes)

    def subgroup(self, members: list[int], tag: str, timeout: float) -> Transport:
        """A new transport over ``members`` (see :meth:`Transport.subgroup`): the TCP
        transport's sub-group, with shared memory between the members that share a host."""
        deadline = time.monotonic() + timeout
        sub = self._tcp.subgroup(members, tag, timeout)
        if sub.size == 1:
            return sub
        return HybridTransport.create(sub, [self.hosts[m] for m in members],
                                      max(0.001, deadline - time.monotonic()), self.ring_bytes,
                                      self.single_copy, self.single_copy_min_bytes)

    # ---------------------------------------------------------------- state

    @property
    def tcp(self) -> TCPTransport:
        """The wrapped TCP transport (frames to the other hosts)."""
        return self._tcp

    @property
    def shm_peers(self) -> list[int]:
        """The peers reached through shared memory."""
        return sorted(self._peers)

    @property
    def single_copy_peers(self) -> list[int]:
        """The shared-memory peers that large frames reach by single copy (they read this
        rank's buffers with ``process_vm_readv``)."""
        return sorted(p for p, peer in self._peers.items() if peer.ch.single_copy)

    def silent_origin(self, peer: int) -> int:
        """See ``TCPTransport.silent_origin``."""
        return self._tcp.silent_origin(peer)

    def _check_usable(self, peer: int) -> _Peer:
        self._check_open()
        p = self._peers.get(peer)
        if p is None:  # pragma: no cover - callers route other peers to TCP
            raise UsageError(f"peer {peer} is not a shared-memory peer of rank {self.rank}")
        return p

    # ---------------------------------------------------------------- frames

    def isend(self, peer: int, payload: memoryview, header: FrameHeader) -> Request:
        """Send through shared memory to a peer of this host, through TCP otherwise (see
        :meth:`Transport.isend`)."""
        if peer not in self._peers:
            return self._routed(lambda: self._tcp.isend(peer, payload, header))
        p = self._check_usable(peer)
        mv = self._payload(payload, header, writable=False)
        single = p.ch.single_copy and header.length >= self.single_copy_min_bytes
        req = _ShmRequest(self, peer, header, mv, True, single)
        # Nothing queued for this peer: copy what fits right here. A single-copy frame
        # waits for the peer: the thread's job.
        if p.claim_send(inline=not single):
            try:
                complete = self._put(p, req, block=False)
            except _Stop:
                req._finish(self._failure or UsageError("the TCP transport is closed"))
                complete = False
            finally:
                p.send_lock.release()
            if complete:
                self.stats_local.add_sent(HEADER_SIZE + header.length)
                req._finish(None)
            elif not req.done():
                with p.lock:
                    p.queued += 1
                p.send_q.put(req)
        else:
            p.send_q.put(req)
        self._fail_late(p)
        return req

    def irecv(self, peer: int, payload: memoryview, header: FrameHeader) -> Request:
        """Receive through shared memory from a peer of this host, through TCP otherwise
        (see :meth:`Transport.irecv`)."""
        if peer not in self._peers:
            return self._routed(lambda: self._tcp.irecv(peer, payload, header))
        p = self._check_usable(peer)
        mv = byte_view(payload, writable=True, what="payload")
        return self._post_receive(p, header, mv.nbytes, mv, None)

    def irecv_consume(self, peer: int, nbytes: int, header: FrameHeader,
                      consume: Consumer) -> Request:
        """See :meth:`Transport.irecv_consume`; from a shared-memory peer the pieces are
        views of the ring itself."""
        if peer not in self._peers:
            return self._routed(lambda: self._tcp.irecv_consume(peer, nbytes, header,
                                                                 consume))
        return self._post_receive(self._check_usable(peer), header, nbytes, memoryview(b""),
                                  consume)

    def _post_receive(self, p: _Peer, header: FrameHeader, nbytes: int, view: memoryview,
                      consume: Consumer | None) -> _ShmRequest:
        self._check_length(header, nbytes)
        req = _ShmRequest(self, p.rank, header, view, False)
        req.consume = consume
        # Large frames and records that cannot sit whole in the ring are the receiver
        # thread's (overlap); the others are read (or consumed) by the thread that waits.
        req.helper = nbytes >= HELPER_RECEIVE_BYTES or \
            _align8(_PREFIX + nbytes) > p.ch.ring_bytes
        with p.lock:
            p.posted.append(req)
        self._start_receive(p, req)
        return req

    @property
    def streams(self) -> bool:  # type: ignore[override]
        """Streams run over TCP: between peers of other hosts (see :meth:`stream`)."""
        return self._tcp.streams

    def stream_folds(self, dtype: np.dtype[Any], op: str) -> bool:
        return self._tcp.stream_folds(dtype, op)

    def stream(self, out_peer: int, in_peer: int, plan: StreamPlan, deadline: float) -> bool:
        """Run ``plan`` over the TCP transport (``TCPTransport.stream``) when both peers are
        on other hosts; False (nothing done) when either is a shared-memory peer or TCP
        declines. A TCP failure fails this transport too."""
        if out_peer in self._peers or in_peer in self._peers:
            return False
        return self._via_tcp(lambda: self._tcp.stream(out_peer, in_peer, plan, deadline))

    def _routed(self, start: Callable[[], Request]) -> Request:
        """Start a TCP request (see :meth:`_via_tcp`)."""
        return _Routed(self, self._via_tcp(start))

    def _via_tcp(self, call: Callable[[], _T]) -> _T:
        """``call()`` on the TCP side, unless this transport is closed or failed (a TCP
        failure is this transport's failure: one record)."""
        self._check_open()
        return call()

    # ---------------------------------------------------------------- ring work

    def _stop_if_over(self, p: _Peer) -> None:
        """Raise _Stop when this transport failed or closes, or when ``p`` aborted (failing
        the transport first)."""
        if self._failure is not None or self._closing:
            raise _Stop
        reason = p.ch.peer_abort_reason()
        if reason is not None:
            self._fail(self._aborted(p, reason))
            raise _Stop

    def _wait(self, p: _Peer, poller: select.poll, fd: int, ready: Callable[[], bool]) -> None:
        """Block until ``ready()``; raise _Stop when this transport failed (the TCP side
        included) or closes (failing it first when the peer aborted or went away)."""
        ch = p.ch
        while not ready():
            self._stop_if_over(p)
            if ch.eof:
                if ready():
                    return
                self._fail(self._lost(p))
                raise _Stop
            for got, _ in shm.wait_bell(poller, shm.WATCH_SECONDS):
                if got == fd:
                    ch.drain(fd)

    def _abort_reason(self, p: _Peer, poller: select.poll) -> str | None:
        """The peer's abort reason, waiting up to :data:`MISMATCH_GRACE_SECONDS` for it (its
        abort rings the data bell, so an abort in progress is seen at once)."""
        ch = p.ch
        end = time.monotonic() + MISMATCH_GRACE_SECONDS
        while True:
            reason = ch.peer_abort_reason()
            left = end - time.monotonic()
            if reason is not None or ch.eof or left <= 0 or self._failure is not None or \
                    self._closing:
                return reason
            for got, _ in shm.wait_bell(poller, left):
                if got == ch.data_in:
                    ch.drain(got)

    def _put(self, p: _Peer, req: _ShmRequest, block: bool) -> bool:
        """Copy the rest of ``req``'s record into the out ring (send lock held); False when
        ``block`` is off and the ring filled up first. A single-copy record is then waited
        on until the peer has copied the payload."""
        ch = p.ch
        ring_bytes = ch.ring_bytes
        total = req.total
        nh = len(req.head)
        end = nh + req.inline
        poller: select.poll | None = None
        while req.pos < total:
            free = ch.out_free()
            if free <= 0:
                if not block:
                    return False
                if poller is None:
                    poller = self._poller(ch.space_out)
                self._wait(p, poller, ch.space_out, lambda: ch.out_free() > 0)
                continue
            off = ch.written % ring_bytes
            a = req.pos
            b = a + min(free, ring_bytes - off, total - a, shm.CHUNK_BYTES)
            if a < nh:
                k = min(b, nh)
                ch.ring_out_mv[off:off + k - a] = req.head[a:k]
            lo, hi = max(a, nh), min(b, end)
            if hi - lo >= _NUMPY_COPY_BYTES:  # numpy releases the GIL while it copies
                ch.ring_out[off + lo - a:off + hi - a] = req.data[lo - nh:hi - nh]
            elif lo < hi:
                ch.ring_out_mv[off + lo - a:off + hi - a] = req.view[lo - nh:hi - nh]
            if b == total and req.single:
                ch.copies_sent += 1
            ch.publish_written(b - a)
            req.pos = b
        if req.single:
            if poller is None:
                poller = self._poller(ch.space_out)
            target = ch.copies_sent
            self._wait(p, poller, ch.space_out, lambda: ch.acked_out() >= target)
        return True

    def _poller(self, fd: int) -> select.poll:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        return poller

    def _take(self, p: _Peer, req: _ShmRequest, poller: select.poll) -> None:
        """Receive the next frame of the in ring into ``req`` (receiver thread)."""
        ch = p.ch
        ring_bytes = ch.ring_bytes
        start = ch.read
        self._wait(p, poller, ch.data_in, lambda: ch.in_avail() >= _PREFIX)
        raw = ch.read_in(start, _PREFIX)
        mode, _ = _RECORD.unpack_from(raw)
        header = FrameHeader.unpack(raw[_RECORD.size:])
        msg = header.mismatch(req.header, p.rank)
        if msg is None and mode not in (_INLINE, _SINGLE):
            msg = f"rank {p.rank} wrote a shared-memory record of unknown mode {mode}"
        if msg is not None:
            # A peer that aborted left the frames of the collective it abandoned here: its
            # reason explains the mismatch better than the headers do.
            reason = self._abort_reason(p, poller)
            self._fail(ProtocolError(msg, rank=self.rank, peer=p.rank,
                                     sequence=req.header.seq,
                                     slots=header.differing(req.header),
                                     collective=self.collective) if reason is None
                       else self._aborted(p, reason))
            raise _Stop
        n = header.length
        if mode == _SINGLE:
            self._copy_from_peer(p, req, poller, start, n)
            return
        end = start + _align8(_PREFIX + n)
        cursor = start + _PREFIX
        consume = req.consume
        while cursor < end:
            avail = ch.written_in() - cursor
            if avail <= 0:
                if cursor > ch.read:
                    ch.publish_read(cursor - ch.read)  # let the sender go on
                self._wait(p, poller, ch.data_in, _beyond(ch, cursor))
                continue
            off = cursor % ring_bytes
            span = min(avail, ring_bytes - off, end - cursor, shm.CHUNK_BYTES)
            at = cursor - start - _PREFIX  # payload offset
            k = min(span, n - at)
            if k > 0:
                if consume is not None:
                    self._consume_piece(p.rank, consume, at, ch.ring_in_mv[off:off + k])
                elif k >= _NUMPY_COPY_BYTES:
                    req.data[at:at + k] = ch.ring_in[off:off + k]
                else:
                    req.view[at:at + k] = ch.ring_in_mv[off:off + k]
            cursor += span
            ch.publish_read(cursor - ch.read)
        if cursor > ch.read:
            ch.publish_read(cursor - ch.read)

    def _copy_from_peer(self, p: _Peer, req: _ShmRequest, poller: select.poll, start: int,
                        n: int) -> None:
        """A single-copy record: read the payload out of the sender's memory (into the
        receive buffer, or piece by piece into a bounce buffer for the consumer), then
        acknowledge it (the sender's request completes)."""
        ch = p.ch
        size = _PREFIX + _ADDRESS.size
        self._wait(p, poller, ch.data_in, lambda: ch.in_avail() >= size)
        (address,) = _ADDRESS.unpack(ch.read_in(start + _PREFIX, _ADDRESS.size))
        consume = req.consume
        piece = shm.SINGLE_COPY_CONSUME_BYTES if consume is not None else \
            shm.SINGLE_COPY_PIECE_BYTES
        if consume is not None and (p.bounce is None or p.bounce.size < piece):
            p.bounce = np.empty(piece, np.uint8)
        at = 0
        while at < n:
            if self._failure is not None or self._closing:
                raise _Stop
            k = min(piece, n - at)
            if consume is None:
                dst = req.data[at:at + k]
            else:
                assert p.bounce is not None
                dst = p.bounce[:k]
            try:
                shm.vm_read(ch.peer_pid, int(dst.ctypes.data), address + at, k)
            except OSError as exc:
                reason = ch.peer_abort_reason()
                if reason is not None:
                    self._fail(self._aborted(p, reason))
                else:
                    self._fail(PeerLostError(
                        f"rank {self.rank}: lost rank {p.rank} (shared memory): reading its "
                        f"buffer failed ({exc.strerror}): rank {p.rank} exited or was killed"))
                raise _Stop from exc
            if consume is not None:
                self._consume_piece(p.rank, consume, at, dst.data)
            at += k
        ch.publish_read(_align8(size), acked=True)

    # ---------------------------------------------------------------- threads

    def _write_queued(self, p: _Peer, req: _ShmRequest) -> BitcollError | None:
        """The sender thread's part (``LinkTransport._send_loop``): copy the rest of a
        frame into the ring (waiting for space), or hand over a single-copy one."""
        try:
            self._put(p, req, block=True)
        except _Stop:
            return self._failure or UsageError("the TCP transport is closed")
        except Exception as exc:  # pragma: no cover - a bug; never hang a peer
            self._fail(CommError(f"rank {self.rank}: shared-memory send to rank {p.rank} "
                                 f"failed: {type(exc).__name__}: {exc}"))
            return self._failure
        self.stats_local.add_sent(HEADER_SIZE + req.header.length)
        return None

    def _helper_loop(self, p: _Peer) -> None:
        """The receiver thread: serve the receives handed to it (large ones, plain or
        consumed, and everything posted while the caller blocks elsewhere), blocking on the
        ring."""

        def busy() -> bool:
            return self._failure is None and not self._closing

        def serve() -> None:
            while busy():
                req = p.head()
                if req is None or not self._serve(p, req):
                    return

        p.serve_handed(serve, busy)

    def _serve(self, p: _Peer, req: _ShmRequest) -> bool:
        """Receive the next record of ``p``'s in ring into ``req`` (its oldest posted
        receive) and complete it; False when the transport failed instead (``req`` failed
        with it). Blocks until the record is there: callers that must not block check
        :meth:`_ready` first. Precondition: the reader token ``p.rx`` is held."""
        try:
            self._take(p, req, self._bell(p))
        except (_Stop, ConsumerFailed):
            req._finish(self._failure or UsageError("the TCP transport is closed"))
            return False
        except ProtocolError as exc:  # bad magic or version
            self._fail(ProtocolError(f"from rank {p.rank}: {exc}", rank=self.rank, peer=p.rank))
            req._finish(self._failure)
            return False
        except Exception as exc:  # pragma: no cover - a bug; never hang a peer
            self._fail(CommError(f"rank {self.rank}: shared-memory receive from rank "
                                 f"{p.rank} failed: {type(exc).__name__}: {exc}"))
            req._finish(self._failure)
            return False
        if p.pop(req):
            self.stats_local.add_received(HEADER_SIZE + req.header.length)
            req._finish(None)
        return True

    def _bell(self, p: _Peer) -> select.poll:
        """The poller of ``p``'s data bell and this rank's wake pipe (reader token held)."""
        if p.poller is None:
            p.poller = self._poller(p.ch.data_in)
        return p.poller

    @staticmethod
    def _ready(ch: shm.ShmChannel, req: _ShmRequest) -> bool:
        """Whether the next record of ``ch``'s in ring can be taken for ``req`` without
        waiting: all of an inline record, the address of a single-copy one, or enough of a
        record that does not match ``req`` for the mismatch to be reported."""
        avail = ch.in_avail()
        if avail >= _align8(_PREFIX + req.header.length):
            return True  # the frame (or more than it: a mismatch, found at once)
        if avail < _PREFIX:
            return False
        raw = ch.read_in(ch.read, _PREFIX)
        mode, _ = _RECORD.unpack_from(raw)
        if mode == _SINGLE:
            return avail >= _PREFIX + _ADDRESS.size
        try:
            length = FrameHeader.unpack(raw[_RECORD.size:]).length
        except ProtocolError:
            return True  # bad magic or version: reported by _serve
        return mode != _INLINE or length != req.header.length

    def _advance(self, p: _Peer, blocking: bool = False) -> Want:
        """Complete the posted receives of ``p`` whose records are in the ring, in order,
        without blocking (whatever ``blocking`` says: a record not there yet is waited for
        by :meth:`_serve`); notice the peer's abort or exit when nothing is there.
        Precondition: the reader token ``p.rx`` is held."""
        ch = p.ch
        while self._failure is None and not self._closing:
            req = p.head()
            if req is None:
                return Want.IDLE
            if req.helper:
                return Want.HELPER
            if not self._ready(ch, req):
                if ch.in_avail() < _PREFIX:
                    reason = ch.peer_abort_reason()
                    if reason is not None:
                        self._fail(self._aborted(p, reason))
                        return Want.IDLE
                    if ch.eof:
                        self._fail(self._lost(p))
                        return Want.IDLE
                return Want.READ
            if not self._serve(p, req):
                return Want.IDLE
        return Want.IDLE

    def _timeout_for(self, req: _ShmRequest) -> CommTimeoutError:
        return timeout_error(self.rank, req, self.silent_origin(req.peer), "; shared memory")

    def _drive(self, req: _ShmRequest, deadline: float) -> None:
        """Make progress on the calling thread until ``req`` (a receive from a shared-memory
        peer) completes, the transport fails or ``deadline`` passes: read the ring, looking
        without sleeping for :data:`~bitcoll.transport.peer.SPIN_SECONDS` (on an oversubscribed
        host :data:`~bitcoll.transport.peer.OVERSUBSCRIBED_SPIN_SECONDS`, yielding the core
        between looks), then block on the data bell (handing every other posted receive to
        its receiver thread first, and looking at the TCP side every
        :data:`~bitcoll.transport.shm.WATCH_SECONDS`). Returns without completing ``req``
        when the receiver thread serves it (the caller then blocks on the request)."""
        p = self._peers[req.peer]
        if not p.rx.acquire(blocking=False):
            self.hand_over()  # the receiver thread reads from p: it serves req too
            return
        want = Want.IDLE
        try:
            spin_end = time.monotonic() + self._spin
            handed = False
            ch = p.ch
            while True:
                want = self._advance(p)
                if want is not Want.READ or req._done:
                    break
                now = time.monotonic()
                if now >= deadline:
                    break
                if now < spin_end:
                    if self.oversubscribed:
                        os.sched_yield()
                    continue
                if not handed:
                    self.hand_over(but=p)
                    handed = True
                rung = False
                for got, _ in shm.wait_bell(self._bell(p),
                                            min(deadline - now, shm.WATCH_SECONDS)):
                    if got == ch.data_in:
                        ch.drain(got)
                        rung = True
                if not rung:  # a quiet moment: read the TCP side's notices (its failure
                    self._tcp.progress()  # is this transport's: _advance sees it)
        finally:
            p.rx.release()
        if want is Want.HELPER:
            self.hand_over()

    def hand_over(self, but: _Peer | None = None) -> None:
        """The calling thread is about to block on something it does not drive: give every
        posted receive (but ``but``'s) to its receiver thread, on both paths."""
        self._hand_over_links(but)
        self._tcp.hand_over()

    def progress(self) -> None:
        """``LinkTransport.progress`` on both paths."""
        super().progress()
        self._tcp.progress()

    def peer_state(self, peer: int) -> PeerState:
        """The :class:`~bitcoll.transport.peer.PeerState` of the link to ``peer``
        (UsageError for a rank that is not another rank of this transport)."""
        p = self._peers.get(peer)
        return self._tcp.peer_state(peer) if p is None else p.state

    def _aborted(self, p: _Peer, reason: str) -> PeerLostError:
        """The error of this rank when ``p`` aborted for ``reason``."""
        return PeerLostError(f"rank {p.rank} aborted: {reason}", rank=self.rank, peer=p.rank)

    def _lost(self, p: _Peer) -> PeerLostError:
        """The error of this rank when ``p`` went away without aborting."""
        return PeerLostError(f"rank {self.rank}: lost rank {p.rank} (shared memory): rank "
                             f"{p.rank} exited, was killed or closed its transport",
                             rank=self.rank, peer=p.rank)

    # ---------------------------------------------------------------- abort / close

    def _spread_failure(self, error: CommError, reason: str) -> None:
        """The shared-memory part of the one failure path (``LinkTransport._fail``; the TCP
        transport, which shares the failure record, does its own part): the reason into
        every shared segment, the bells rung, every shared-memory link FAILED. Never
        raises."""
        raw = reason.encode("utf-8", errors="replace")[:shm.MAX_REASON_BYTES]
        for p in self._peers.values():
            with contextlib.suppress(ValueError, BufferError):
                p.ch.set_aborted(raw)
        self._wake()
        for p in self._peers.values():
            p.stop(PeerState.FAILED, error)

    def close(self, timeout: float | None = None) -> None:
        """Let queued sends finish (within ``timeout``, default the TCP transport's
        ``close_timeout``), stop the threads, unmap the segments, close the TCP transport.
        Requests still pending fail with UsageError. Idempotent; never raises."""
        deadline = self._begin_close(timeout, self.close_timeout)
        if deadline is None:
            return
        self._close_links(list(self._peers.values()), deadline, lambda p: None,
                          lambda p: p.ch.close())
        self._tcp.close(max(0.0, deadline - time.monotonic()))


def _beyond(ch: shm.ShmChannel, cursor: int) -> Callable[[], bool]:
    """Whether the in ring holds bytes past stream position ``cursor``."""
    return lambda: ch.written_in() > cursor


def _setup_header(step: int, length: int) -> FrameHeader:
    return FrameHeader(seq=SETUP_SEQ, step=step, signature=_SETUP_SIG, length=length)
