"""The TCP transport: bitcoll frames over one TCP connection per pair of ranks.

Set-up (:meth:`TCPTransport.create`)
------------------------------------
1. The *rendezvous*: rank 0 serves bitcoll's store (:mod:`bitcoll.transport.store`) at
   ``master_addr:master_port`` and every rank (rank 0 included) connects to it, retrying until
   the deadline; or, with ``store=``, every rank uses a store the job already has (torchrun's
   agent store, torch.distributed's; :mod:`bitcoll.transport.external_store`) under the key
   namespace ``bitcoll/<k>/`` (``k`` counts the worlds this rank built on it). Every
   connection to bitcoll's own store proves the job's *secret* both ways
   (:mod:`bitcoll.transport.auth`: ``BITCOLL_SECRET``, or a private file rank 0 writes); the
   store's *generation* (the how-manieth world this process builds on that address) keeps a
   rank that re-creates a communicator from talking to rank 0's previous store. Rank 0 writes
   the world size and a random 64-bit *job id*; the other ranks read them (a different world
   size is a :class:`~bitcoll.errors.UsageError`) and register their rank (two processes
   claiming one rank is a UsageError).
2. Every rank listens on an ephemeral port and publishes ``"<port> <host>"`` under
   ``addr/<rank>``. The host is ``listen_addr`` if given, otherwise the local address this
   rank uses to reach the store (so loopback when ``master_addr`` is loopback); a wildcard
   ``listen_addr`` (``0.0.0.0`` or ``::``) binds everywhere and publishes that address.
3. The lower rank of each pair connects to the higher one and the two run the authenticated
   hello of :mod:`bitcoll.transport.handshake` (nonces from both sides, proofs of the secret
   bound to the job, both ranks, the direction and the address dialed). The acceptor drops, and
   logs at debug level (logger ``bitcoll.tcp``), every connection that is not a lower rank of
   this job or fails the proof, and goes on waiting for the real one; for the connector a
   failed answer is a :class:`~bitcoll.errors.ProtocolError`. Every socket gets
   ``TCP_NODELAY`` and :data:`SOCKET_BUFFER_BYTES` send/receive buffers. Rank 0 then removes
   its secret file (every rank has proven it read it).

:meth:`TCPTransport.subgroup` repeats steps 1 (through the same store, under a new
namespace) to 3 for a subset of the ranks: sub-communicators get connections of their own, so
their frames can never mix with the parent's or a sibling's.

A rank whose peers do not all show up before the deadline raises
:class:`~bitcoll.errors.CommTimeoutError` naming them. ``size == 1`` needs no store and no
socket.

Data path
---------
Per peer, one *sender* thread takes frames from a FIFO queue and writes header and payload with
one ``sendmsg`` straight from the caller's buffer (no copy; the GIL is released while the
kernel copies), so frames to one peer leave in ``isend`` order and any number of them can be
queued. When nothing is queued or being written to that peer, ``isend`` itself first writes
what the socket takes without blocking (``MSG_DONTWAIT``) and queues only the rest, so small
frames leave without waking a thread.

One *receiver* thread per peer matches frames with posted receives in posting order. When a
receive is posted it reads the header together with whatever part of the payload has arrived
(one ``recvmsg_into`` into the header buffer and the caller's buffer), compares the header
with the expected one, then reads the rest of the payload straight into the caller's buffer
(``recv_into`` with ``MSG_WAITALL``). When nothing is posted it still reads the next header as
soon as it arrives, so an abort notice or a lost connection is noticed at once.

Requests complete by releasing a lock. Nothing is pickled and payloads are never copied in user
space. Sends to different peers, and sends and receives, all proceed concurrently.

Traffic counters
----------------
:attr:`TCPTransport.stats` counts frames: one message and ``HEADER_SIZE + payload length``
bytes per frame, exactly the bytes written to / read from the socket for it. A send is counted
when the kernel has taken all of it, a receive when it is complete. The handshake (24 bytes
each way per connection), abort notices and the rendezvous store's traffic are not counted.

Failure
-------
* A header that differs from the expected one fails that receive with
  :class:`~bitcoll.errors.ProtocolError` (message from :meth:`FrameHeader.mismatch`) and
  aborts the transport.
* A connection that breaks while a frame is in flight or a receive from that peer is posted
  (end of file, reset, write error) fails the transport with
  :class:`~bitcoll.errors.PeerLostError` naming the peer; when the peer left an abort reason in
  the store the message is ``"rank <p> aborted: <reason>"``. A connection closed cleanly
  between frames while nothing is posted from that peer (the peer closed its transport) only
  marks the peer as gone: the next ``isend``/``irecv`` involving it fails the transport.
* :meth:`TCPTransport.abort` (also run on every internal failure) records the error, sends an
  ABORT frame (:attr:`FrameKind.ABORT`, payload = the UTF-8 reason) to every peer whose
  connection is between frames, writes the reason under ``bitcoll/abort/<rank>`` in the store
  (for the peers whose connection was in the middle of a frame), then shuts down the sending
  side of every connection (a send blocked in the kernel fails at once). Peers fail within
  milliseconds with ``PeerLostError("rank <r> aborted: <reason>")``. The receiver threads
  keep reading and dropping what peers still send until they close, so no peer stays blocked
  writing to an aborted rank. The buffer of a failed receive may still be written into until
  :meth:`TCPTransport.close` returns.
* After a failure, :attr:`TCPTransport.failure` is the error, every pending request fails with
  it and every ``isend``/``irecv`` raises it. ``Request.wait`` past its deadline raises
  :class:`~bitcoll.errors.CommTimeoutError` and leaves the transport as it is (the caller, as
  the communicator does, decides whether to abort).

``close()`` lets the queued sends finish (within the close timeout), shuts down the sockets,
joins the threads and fails requests still pending with UsageError. Rank 0 keeps serving the
store until every other rank has disconnected from it (closed its transport or exited) or the
close timeout passes.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import queue
import selectors
import socket
import threading
import time
from collections.abc import Iterable
from typing import Any, Final, Protocol

from ..config import DEFAULT_TIMEOUT
from ..errors import (
    BitcollError,
    CommError,
    CommTimeoutError,
    PeerLostError,
    ProtocolError,
    UsageError,
)
from . import auth, handshake
from .base import (
    HEADER_SIZE,
    Consumer,
    FrameHeader,
    FrameKind,
    Request,
    TrafficStats,
    Transport,
    byte_view,
    drain_peer,
)
from .external_store import ExternalStore, check_store
from .store import StoreClient, StoreServer

__all__ = ["TCPTransport", "SOCKET_BUFFER_BYTES"]

#: Requested SO_SNDBUF / SO_RCVBUF of every data connection (the kernel doubles it and may
#: cap it). Enough for the bandwidth-delay product of 10 GbE at sub-millisecond RTT; larger
#: buffers let queued data fall out of the CPU caches before the receiver copies it, which
#: measurably slowed 4-rank all-reduces on one host.
SOCKET_BUFFER_BYTES: Final = 1 << 20
#: Piece size of :meth:`TCPTransport.irecv_consume`: small enough to stay in a core's L2
#: cache between the kernel's copy and the consumer's read.
CONSUME_CHUNK_BYTES: Final = 256 << 10
#: Bytes of a frame's integrity tag (``integrity=True``): keyed BLAKE3, 128 bits.
FRAME_TAG_BYTES: Final = 16
#: Longest abort reason carried by an ABORT frame or read from one.
MAX_REASON_BYTES: Final = 16 << 10
#: How long an abort spends at most writing its reason into the store.
ABORT_STORE_SECONDS: Final = 0.5
#: Default of ``close_timeout``: how long ``close()`` waits for queued sends and for the
#: other ranks to leave rank 0's store.
CLOSE_TIMEOUT: Final = 30.0
#: After a failure rank 0 keeps its store at most this long for peers to read abort reasons.
FAILED_CLOSE_SECONDS: Final = 2.0

# Store keys, under the transport's namespace (``bitcoll/`` in its own store).
KEY_SIZE: Final = "size"
KEY_JOB: Final = "job"
KEY_JOIN: Final = "join/{}"
KEY_ADDR: Final = "addr/{}"
KEY_ABORT: Final = "abort/{}"
KEY_SECRET_FILE: Final = "secretfile"
KEY_STALL: Final = "stall/{}"
KEY_INTEGRITY: Final = "integrity"
#: How long a rank that timed out waits for the ranks it waited on to report whom they
#: waited on (see :meth:`TCPTransport.silent_origin`), and how often it looks.
STALL_GRACE_SECONDS: Final = 2.0
STALL_POLL_SECONDS: Final = 0.02

_log = logging.getLogger("bitcoll.tcp")

_NOSIGNAL: Final = getattr(socket, "MSG_NOSIGNAL", 0)
_DONTWAIT: Final = getattr(socket, "MSG_DONTWAIT", 0)
_WAITALL: Final = getattr(socket, "MSG_WAITALL", 0)


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def _recv_exact(sock: socket.socket, view: memoryview) -> int:
    """Fill ``view`` from ``sock``; return the number of bytes read (short only at EOF)."""
    n = len(view)
    got = sock.recv_into(view, n, _WAITALL)
    while 0 < got < n:
        k = sock.recv_into(view[got:], n - got, _WAITALL)
        if k == 0:
            break
        got += k
    return got


def _send_some(sock: socket.socket, head: bytes, view: memoryview, tail: bytes,
               flags: int) -> int:
    """One ``sendmsg`` of ``head`` + ``view`` + ``tail``; the number of bytes the kernel
    took."""
    parts: list[bytes | memoryview] = [head]
    if len(view):
        parts.append(view)
    if tail:
        parts.append(tail)
    try:
        return sock.sendmsg(parts, (), flags) if len(parts) > 1 else sock.send(head, flags)
    except BlockingIOError:  # only with MSG_DONTWAIT: nothing fits right now
        return 0


def _send_frame(sock: socket.socket, head: bytes, view: memoryview, tail: bytes,
                sent: int = 0) -> None:
    """Write ``head``, ``view`` and ``tail`` completely, minus the ``sent`` bytes already
    written (one ``sendmsg`` in the common case)."""
    if sent == 0:
        sent = _send_some(sock, head, view, tail, _NOSIGNAL)
    if sent < HEADER_SIZE:
        sock.sendall(head[sent:], _NOSIGNAL)
        sent = HEADER_SIZE
    end = HEADER_SIZE + len(view)
    if sent < end:
        sock.sendall(view[sent - HEADER_SIZE:], _NOSIGNAL)
        sent = end
    if sent - end < len(tail):
        sock.sendall(tail[sent - end:], _NOSIGNAL)


def blake3_module() -> Any:
    """The ``blake3`` module (the keyed hash of ``integrity=True``); UsageError when it is
    not installed."""
    try:
        import blake3
    except ImportError:
        raise UsageError("integrity=True needs the blake3 package: pip install "
                         "'bitcoll[integrity]' (or pip install blake3)") from None
    return blake3


def _tag_hasher(key: bytes, counter: int, head: bytes) -> Any:
    """A keyed BLAKE3 over ``counter`` and ``head``, to be fed the payload."""
    h = blake3_module().blake3(key=key)
    h.update(counter.to_bytes(8, "little"))
    h.update(head)
    return h


def _frame_tag(key: bytes, counter: int, head: bytes, payload: memoryview) -> bytes:
    """The integrity tag of one frame: keyed BLAKE3 of its number in this direction, its
    header and its payload, truncated to :data:`FRAME_TAG_BYTES` bytes."""
    h = _tag_hasher(key, counter, head)
    h.update(payload)
    return bytes(h.digest(FRAME_TAG_BYTES))


def _tune(sock: socket.socket) -> None:
    """TCP_NODELAY and large buffers (set before connect/listen so the window scales)."""
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if SOCKET_BUFFER_BYTES:
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            with contextlib.suppress(OSError):
                if sock.getsockopt(socket.SOL_SOCKET, opt) < SOCKET_BUFFER_BYTES:
                    sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER_BYTES)


def _ranks(ranks: list[int] | set[int]) -> str:
    r = sorted(ranks)
    return ("rank " if len(r) == 1 else "ranks ") + ", ".join(str(x) for x in r)


class _ConsumerFailed(Exception):
    """A consumer of :meth:`TCPTransport.irecv_consume` raised (the transport has failed)."""


class _TCPRequest(Request):
    """A pending send or receive of one frame.

    Completion is signalled by releasing a lock taken at creation (cheaper than an Event:
    one C call on each side, no Python-level condition).
    """

    __slots__ = ("_done", "_error", "_lock", "_owner", "consume", "head", "header", "is_send",
                 "peer", "posted", "sent", "tail", "view")

    def __init__(self, owner: TCPTransport, peer: int, header: FrameHeader, view: memoryview,
                 is_send: bool) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()
        self._done = False
        self._error: BitcollError | None = None
        self._owner = owner
        self.peer = peer
        self.header = header
        self.view = view
        self.head = header.pack() if is_send else b""
        self.tail = b""  # the frame's integrity tag (sends, with frame integrity on)
        self.is_send = is_send
        self.posted = time.monotonic()
        self.sent = 0  # bytes of a send already written by isend itself
        self.consume: Consumer | None = None  # irecv_consume: the payload goes here

    def _finish(self, error: BitcollError | None) -> None:
        if self._done:
            return
        self._error = error
        self._done = True
        with contextlib.suppress(RuntimeError):  # a concurrent _finish released it already
            self._lock.release()

    def done(self) -> bool:
        return self._done

    def wait(self, deadline: float) -> None:
        if not self._done:
            left = deadline - time.monotonic()
            if left <= 0 or not self._lock.acquire(timeout=min(left, threading.TIMEOUT_MAX)):
                h = self.header
                what = (f"send to rank {self.peer}" if self.is_send
                        else f"receive from rank {self.peer}")
                waited = time.monotonic() - self.posted
                silent = self._owner.silent_origin(self.peer)
                why = "" if silent == self.peer else (
                    f"; rank {self.peer} was itself waiting: rank {silent} is the one that "
                    "went silent")
                raise CommTimeoutError(
                    f"rank {self._owner.rank}: {what} (collective #{h.seq}, step {h.step}, "
                    f"{h.length} bytes) did not complete before the deadline "
                    f"({waited:.3g} s after it was posted){why}", rank=self._owner.rank,
                    peer=self.peer, sequence=h.seq, silent=silent)
            self._lock.release()
        if self._error is not None:
            raise self._error.with_traceback(None)


class _Peer:
    """One connection and its two threads."""

    def __init__(self, rank: int, sock: socket.socket) -> None:
        self.rank = rank
        self.sock = sock
        self.send_q: queue.SimpleQueue[_TCPRequest | None] = queue.SimpleQueue()
        self.recv_q: queue.SimpleQueue[_TCPRequest | None] = queue.SimpleQueue()
        self.send_lock = threading.Lock()  # held while a frame is being written
        self.state = threading.Lock()  # guards ``queued``
        self.queued = 0  # sends handed to the sender thread and not finished by it
        self.partial = False  # isend wrote part of a frame; the sender thread ends it
        self.eof = False  # the peer closed the connection cleanly between frames
        self.current: _TCPRequest | None = None  # the receive whose payload is being read
        self.bounce = memoryview(bytearray(CONSUME_CHUNK_BYTES))  # irecv_consume's buffer
        # Frame integrity (None when off): keys and frame counters of each direction; the
        # MAC lock keeps counters in isend order.
        self.key_out: bytes | None = None
        self.key_in: bytes | None = None
        self.count_out = 0
        self.count_in = 0
        self.mac_lock = threading.Lock()
        self.consume_mac: Any = None  # the tag hasher of the frame being consumed
        self.sender: threading.Thread | None = None
        self.receiver: threading.Thread | None = None


# --------------------------------------------------------------------------------------------
# The transport
# --------------------------------------------------------------------------------------------


class TCPTransport(Transport):
    """Frames between the ranks of one job over TCP. Build it with :meth:`create`."""

    name = "tcp"

    def __init__(self, rank: int, size: int, socks: dict[int, socket.socket],
                 rendezvous: _Rendezvous | None, job_id: int,
                 close_timeout: float = CLOSE_TIMEOUT, integrity: bool = False) -> None:
        """Wrap established connections (use :meth:`create` instead)."""
        self.rank = rank
        self.size = size
        self.stats = TrafficStats()
        self.job_id = job_id
        self.integrity = integrity
        self.close_timeout = close_timeout
        self._rdv = rendezvous
        self._store: RendezvousStore | None = None if rendezvous is None else rendezvous.store
        self._groups = 0  # sub-groups made so far (their key namespaces)
        self._lock = threading.Lock()
        self._failure: CommError | None = None
        self._closed = False
        self._closing = False
        self._peers: dict[int, _Peer] = {p: _Peer(p, s) for p, s in socks.items()}
        if integrity and rendezvous is not None:
            for peer in self._peers.values():
                peer.key_out = auth.mac(rendezvous.secret, "frame-key", job_id, rank, peer.rank)
                peer.key_in = auth.mac(rendezvous.secret, "frame-key", job_id, peer.rank, rank)
        for peer in self._peers.values():
            peer.sender = threading.Thread(target=self._send_loop, args=(peer,), daemon=True,
                                           name=f"bitcoll-tcp-send-{rank}-to-{peer.rank}")
            peer.receiver = threading.Thread(target=self._recv_loop, args=(peer,), daemon=True,
                                             name=f"bitcoll-tcp-recv-{rank}-from-{peer.rank}")
            peer.sender.start()
            peer.receiver.start()

    # ---------------------------------------------------------------- set-up

    @classmethod
    def create(cls, rank: int, size: int, master_addr: str, master_port: int,
               timeout: float = DEFAULT_TIMEOUT, listen_addr: str | None = None, *,
               store: object | None = None, integrity: bool = False,
               close_timeout: float = CLOSE_TIMEOUT) -> TCPTransport:
        """Connect the ``size`` ranks of a job; see the module docstring for the steps.

        ``rank`` in ``[0, size)``. Without ``store``, rank 0 serves bitcoll's authenticated
        store at ``master_addr:master_port`` (``master_port`` in 1..65535) and the others
        connect to it; with ``store`` (a torch.distributed ``Store`` or any object with its
        ``set``/``get``/``add``/``wait`` methods) every rank uses that store instead and
        ``master_addr``/``master_port`` only help to find the local address. ``timeout``
        (seconds) bounds the whole set-up. ``listen_addr``: the address to accept peer
        connections on (default: the local address used to reach the store's host).
        ``integrity``: every data frame carries a keyed BLAKE3 tag of its number, header and
        payload (:data:`FRAME_TAG_BYTES` bytes), checked on arrival: a frame altered or
        injected on the way is a ProtocolError (every rank must pass the same value; needs
        the ``blake3`` package).
        ``close_timeout``: see :meth:`close`.

        Raises UsageError for bad arguments, a world size that differs from rank 0's, a rank
        claimed twice or a secret that cannot be had (see :mod:`bitcoll.transport.auth`);
        CommTimeoutError naming the ranks that did not show up before the deadline (rank 0
        itself when no store answers); CommError when the store's port cannot be bound;
        PeerLostError or ProtocolError when a peer breaks the handshake.
        """
        if size < 1:
            raise UsageError(f"world size must be >= 1, got {size}")
        if not 0 <= rank < size:
            raise UsageError(f"rank {rank} is not in [0, {size})")
        if timeout <= 0:
            raise UsageError(f"timeout must be > 0 seconds, got {timeout}")
        if store is not None:
            check_store(store)
        if integrity:
            blake3_module()
        if size == 1:
            return cls(0, 1, {}, None, 0, close_timeout)
        if store is None and not 0 < master_port < 65536:
            raise UsageError(f"master_port must be in 1..65535, got {master_port}")
        deadline = time.monotonic() + timeout
        secret = auth.env_secret()
        rdv = (_Rendezvous.own(rank, master_addr, master_port, secret, deadline, timeout)
               if store is None else
               _Rendezvous.external(rank, store, master_addr, secret, deadline))
        try:
            return cls._build(rank, size, rdv, deadline, timeout, listen_addr, close_timeout,
                              integrity)
        except BaseException:
            rdv.close(min(deadline, time.monotonic()) + FAILED_CLOSE_SECONDS)
            raise
        finally:
            rdv.forget_secret_file()  # every peer proved the secret (or set-up failed)

    def subgroup(self, members: list[int], tag: str, timeout: float) -> TCPTransport:
        """A new transport over the ranks ``members`` of this one (this rank among them),
        with its own connections, built through this transport's store under a key namespace
        named by ``tag`` (the same on every member, unique among this transport's groups).
        Ranks of the new transport are positions in ``members``. Collective over
        ``members``; raises like :meth:`create`."""
        if self.rank not in members:
            raise UsageError(f"rank {self.rank} is not among the members {members}")
        if self._rdv is None or len(members) == 1:
            return TCPTransport(0, 1, {}, None, 0, self.close_timeout)
        deadline = time.monotonic() + timeout
        rdv = self._rdv.child(f"group/{tag}/")
        return self._build(members.index(self.rank), len(members), rdv, deadline, timeout,
                           None, self.close_timeout, self.integrity)

    @classmethod
    def _build(cls, rank: int, size: int, rdv: _Rendezvous, deadline: float, timeout: float,
               listen_addr: str | None, close_timeout: float,
               integrity: bool) -> TCPTransport:
        """Steps 2-4 of the set-up: job id, join, publish the listener, connect the mesh."""
        store, key = rdv.store, rdv.key
        where = rdv.where
        listener: socket.socket | None = None
        try:
            if rank == 0:
                job_id = int.from_bytes(os.urandom(8), "little")
                store.set(key(KEY_SIZE), str(size).encode(), deadline)
                store.set(key(KEY_INTEGRITY), b"1" if integrity else b"0", deadline)
                store.set(key(KEY_JOB), str(job_id).encode(), deadline)
            else:
                job_id = int(store.get(key(KEY_JOB), deadline))
                size0 = int(store.get(key(KEY_SIZE), deadline))
                if size0 != size:
                    raise UsageError(f"rank {rank} was started with world size {size} but "
                                     f"rank 0 with {size0}")
                integrity0 = store.get(key(KEY_INTEGRITY), deadline) == b"1"
                if integrity0 != integrity:
                    raise UsageError(f"rank {rank} was started with integrity={integrity} but "
                                     f"rank 0 with integrity={integrity0}")
            if store.add(key(KEY_JOIN.format(rank)), 1, deadline) != 1:
                raise UsageError(f"two processes claim rank {rank} of the job at {where}")
            listener, host = cls._listen(store, listen_addr, size)
            mine = f"{listener.getsockname()[1]} {host}"
            store.set(key(KEY_ADDR.format(rank)), mine.encode(), deadline)
            keys = [key(KEY_ADDR.format(p)) for p in range(size) if p != rank]
            try:
                store.wait(keys, deadline)
            except CommTimeoutError:
                missing = [int(k.rsplit("/", 1)[1]) for k in store.missing(keys)]
                raise CommTimeoutError(
                    f"rank {rank}: {_ranks(missing)} never showed up at the rendezvous store "
                    f"{where} within {timeout:g} s") from None
            addrs = {p: store.get(key(KEY_ADDR.format(p)), deadline).decode()
                     for p in range(rank + 1, size)}
            socks = _Mesh(rank, size, job_id, rdv.secret, mine, deadline, timeout).connect(
                listener, addrs)
        finally:
            if listener is not None:
                listener.close()
        return cls(rank, size, socks, rdv, job_id, close_timeout, integrity)

    @staticmethod
    def _listen(store: RendezvousStore, listen_addr: str | None,
                size: int) -> tuple[socket.socket, str]:
        """Bind the listener; return it and the host to publish."""
        local = store.local_address
        if listen_addr is None:
            bind_host, publish = local, local
        elif listen_addr in ("", "0.0.0.0", "::"):
            bind_host, publish = listen_addr, local
        else:
            bind_host, publish = listen_addr, listen_addr
        try:
            infos = socket.getaddrinfo(bind_host or None, 0, type=socket.SOCK_STREAM,
                                       flags=socket.AI_PASSIVE)
            family, _, _, _, sockaddr = infos[0]
        except socket.gaierror as exc:
            raise UsageError(f"cannot resolve listen address {bind_host!r}: {exc}") from exc
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            _tune(sock)
            sock.bind(sockaddr)
            sock.listen(max(16, 2 * size))
        except OSError as exc:
            sock.close()
            raise CommError(f"cannot listen on {bind_host!r}: {exc}") from exc
        return sock, publish

    # ---------------------------------------------------------------- state

    def _key(self, suffix: str) -> str:
        assert self._rdv is not None
        return self._rdv.key(suffix)

    @property
    def failure(self) -> CommError | None:
        """The error that aborted this transport, or None while it is healthy."""
        return self._failure

    def _check_usable(self, peer: int) -> _Peer:
        if self._closed:
            raise UsageError("the TCP transport is closed")
        failure = self._failure
        if failure is not None:
            raise failure.with_traceback(None)
        p = self._peers.get(peer)
        if p is None:
            raise UsageError(f"peer {peer} is not another rank of this {self.size}-rank "
                             f"transport (this is rank {self.rank})")
        return p

    # ---------------------------------------------------------------- frames

    def isend(self, peer: int, payload: memoryview, header: FrameHeader) -> Request:
        """Queue ``header`` + ``payload`` for ``peer`` and return at once.

        ``payload`` (any C-contiguous buffer) must stay alive and unmodified until the request
        completes; ``header.length`` must equal its size in bytes (UsageError otherwise).
        Raises the transport's failure after an abort, PeerLostError (and aborts) when the
        peer has closed its connection, UsageError after close or for a bad peer.
        """
        p = self._check_usable(peer)
        mv = byte_view(payload, writable=False, what="payload")
        if header.length != mv.nbytes:
            raise UsageError(f"header.length is {header.length} but the payload has "
                             f"{mv.nbytes} bytes")
        if p.eof:
            self._peer_gone(p)
        req = _TCPRequest(self, peer, header, mv, True)
        if p.key_out is None:
            self._submit(p, req)
        else:
            with p.mac_lock:  # counters in submission order
                req.tail = _frame_tag(p.key_out, p.count_out, req.head, mv)
                p.count_out += 1
                self._submit(p, req)
        if self._failure is not None:
            self._drain(p, self._failure)
        return req

    def _submit(self, p: _Peer, req: _TCPRequest) -> None:
        with p.state:
            # Nothing queued or being written to this peer: try to write the frame right
            # here (saves waking the sender thread; order is kept since no frame is ahead).
            inline = p.queued == 0 and p.send_lock.acquire(blocking=False)
            if not inline:
                p.queued += 1
        if inline:
            try:
                self._send_inline(p, req)
            finally:
                p.send_lock.release()
        else:
            p.send_q.put(req)

    def _send_inline(self, p: _Peer, req: _TCPRequest) -> None:
        """Write what the socket takes without blocking; queue the rest (send lock held)."""
        if self._failure is not None:
            req._finish(self._failure)
            return
        total = HEADER_SIZE + len(req.view) + len(req.tail)
        try:
            sent = _send_some(p.sock, req.head, req.view, req.tail, _NOSIGNAL | _DONTWAIT)
        except OSError as exc:
            if self._failure is None and not self._closing:
                self._fail(PeerLostError(self._lost_message(p.rank, exc)))
            req._finish(self._failure or UsageError("the TCP transport is closed"))
            return
        if sent == total:
            self.stats.add_sent(total)
            req._finish(None)
            return
        req.sent = sent
        p.partial = sent > 0
        with p.state:
            p.queued += 1
        p.send_q.put(req)

    def irecv(self, peer: int, payload: memoryview, header: FrameHeader) -> Request:
        """Post a receive of the next frame from ``peer`` into ``payload`` and return at once.

        ``payload`` (writable, C-contiguous) must hold exactly ``header.length`` bytes
        (UsageError otherwise) and stay alive until the request completes. The request fails
        with ProtocolError (and aborts the transport) when the frame's header differs from
        ``header``. Raises like :meth:`isend`.
        """
        p = self._check_usable(peer)
        mv = byte_view(payload, writable=True, what="payload")
        return self._post_receive(p, header, mv.nbytes, mv, None)

    def _post_receive(self, p: _Peer, header: FrameHeader, nbytes: int, view: memoryview,
                      consume: Consumer | None) -> _TCPRequest:
        """Queue a receive for ``p``'s receiver thread (checks shared by both irecv forms)."""
        if header.length != nbytes:
            raise UsageError(f"header.length is {header.length} but the payload has "
                             f"{nbytes} bytes")
        if p.eof:
            self._peer_gone(p)
        req = _TCPRequest(self, p.rank, header, view, False)
        req.consume = consume
        p.recv_q.put(req)
        if p.eof and self._failure is None:
            # The connection ended while we were posting: the receiver will not see it.
            self._fail(PeerLostError(self._lost_message(p.rank, None)))
        if self._failure is not None:
            self._drain(p, self._failure)
        return req

    consumes_on_receive = True

    def irecv_consume(self, peer: int, nbytes: int, header: FrameHeader,
                      consume: Consumer) -> Request:
        """Post a receive of the next frame from ``peer`` whose ``nbytes`` of payload the
        receiver thread reads into a small per-peer buffer, :data:`CONSUME_CHUNK_BYTES` at a
        time, and hands to ``consume(offset, chunk)`` (see :meth:`Transport.irecv_consume`).
        Raises like :meth:`irecv`."""
        return self._post_receive(self._check_usable(peer), header, nbytes, memoryview(b""),
                                  consume)

    def _consume(self, p: _Peer, req: _TCPRequest, n: int, header_bytes: bytes) -> bool:
        """Read ``n`` payload bytes and feed them to ``req.consume``; False at end of file.
        An exception from the consumer fails the transport (and so the request)."""
        assert req.consume is not None
        chunk = p.bounce
        pos = 0
        mac = None
        if p.key_in is not None:
            mac = _tag_hasher(p.key_in, p.count_in, header_bytes)
            p.consume_mac = mac
        while pos < n:
            k = min(len(chunk), n - pos)
            if _recv_exact(p.sock, chunk[:k]) < k:
                return False
            if mac is not None:
                mac.update(chunk[:k])
            try:
                req.consume(pos, chunk[:k])
            except Exception as exc:  # a local failure: report it everywhere
                self._fail(CommError(f"rank {self.rank}: consuming a frame from rank "
                                     f"{p.rank} failed: {type(exc).__name__}: {exc}"))
                raise _ConsumerFailed from exc
            pos += k
        return True

    def silent_origin(self, peer: int) -> int:
        """This rank timed out waiting for ``peer``: record that in the store and follow the
        chain of ranks that timed out waiting for others (each leaves ``stall/<rank>``) to
        the first one that is not waiting for anybody: the rank the silence started from
        (``peer`` itself when it left no record within :data:`STALL_GRACE_SECONDS`, or when
        the chain runs in a circle). Never raises."""
        store = self._store
        if store is None:
            return peer
        with contextlib.suppress(CommError):
            store.set(self._key(KEY_STALL.format(self.rank)), str(peer).encode(),
                      time.monotonic() + ABORT_STORE_SECONDS)
        chain = [self.rank]
        current = peer
        end = time.monotonic() + STALL_GRACE_SECONDS
        while current not in chain:
            chain.append(current)
            raw: bytes | None = None
            while raw is None and time.monotonic() < end:
                try:
                    raw = store.try_get(self._key(KEY_STALL.format(current)),
                                        time.monotonic() + ABORT_STORE_SECONDS)
                except CommError:
                    return current
                if raw is None:
                    time.sleep(STALL_POLL_SECONDS)
            if raw is None or not raw.isdigit() or int(raw) >= self.size:
                return current
            current = int(raw)
        return peer

    def _peer_gone(self, p: _Peer) -> None:
        """A call involves a peer that closed its connection: fail and raise."""
        error = PeerLostError(self._lost_message(p.rank, None))
        self._fail(error)
        raise (self._failure or error).with_traceback(None)

    # ---------------------------------------------------------------- threads

    def _send_loop(self, p: _Peer) -> None:
        sock = p.sock
        stats = self.stats
        while True:
            req = p.send_q.get()
            if req is None:
                return
            with p.send_lock:
                failure = self._failure
                if failure is not None:
                    error: BitcollError | None = failure
                else:
                    try:
                        _send_frame(sock, req.head, req.view, req.tail, req.sent)
                        p.partial = False
                        error = None
                    except OSError as exc:
                        if self._failure is None and not self._closing:
                            self._fail(PeerLostError(self._lost_message(p.rank, exc)))
                        error = self._failure or UsageError("the TCP transport is closed")
                with p.state:
                    p.queued -= 1
            if error is None:
                stats.add_sent(HEADER_SIZE + len(req.view) + len(req.tail))
            req._finish(error)

    def _recv_loop(self, p: _Peer) -> None:
        sock = p.sock
        stats = self.stats
        recv_q = p.recv_q
        hbuf = bytearray(HEADER_SIZE)
        hview = memoryview(hbuf)
        try:
            while self._failure is None:
                try:
                    req = recv_q.get_nowait()
                except queue.Empty:
                    req = None
                    got = 0
                else:
                    if req is None:
                        break
                    # A receive is posted: take the header and whatever part of the payload
                    # is already there with one call.
                    p.current = req
                    got = (sock.recvmsg_into((hview, req.view))[0] if len(req.view)
                           else sock.recv_into(hview))
                    if got == 0:
                        p.current = None
                        self._eof(p, req, between_frames=True)
                        return
                if got < HEADER_SIZE:
                    # Wait for a header even when nothing is posted, so that an abort notice
                    # or a lost connection is seen at once.
                    k = _recv_exact(sock, hview[got:])
                    if got + k < HEADER_SIZE:
                        p.current = None
                        self._eof(p, req, between_frames=got + k == 0)
                        return
                    got = HEADER_SIZE
                header = FrameHeader.unpack(hbuf)
                if header.kind == FrameKind.ABORT:
                    p.current = None
                    self._abort_notice(p, header, req, got - HEADER_SIZE)
                    break
                if req is None:
                    req = recv_q.get()
                    if req is None:
                        break
                    p.current = req
                    got = HEADER_SIZE
                msg = header.mismatch(req.header, p.rank)
                if msg is not None:
                    p.current = None
                    # A peer that aborted in the middle of a frame left that frame's header
                    # here: its reason explains the mismatch better than the headers do.
                    aborted = self._abort_reason(p.rank)
                    self._fail(ProtocolError(msg) if aborted is None
                               else PeerLostError(aborted))
                    req._finish(self._failure)
                    break
                body = got - HEADER_SIZE
                if req.consume is not None:
                    try:
                        complete = self._consume(p, req, header.length, bytes(hbuf))
                    except _ConsumerFailed:
                        p.current = None
                        req._finish(self._failure)
                        break
                    if not complete:
                        p.current = None
                        self._eof(p, req, between_frames=False)
                        return
                elif body < header.length and \
                        body + _recv_exact(sock, req.view[body:]) < header.length:
                    p.current = None
                    self._eof(p, req, between_frames=False)
                    return
                extra = 0
                if p.key_in is not None:
                    if not self._check_tag(p, hbuf, req):
                        break
                    extra = FRAME_TAG_BYTES
                p.current = None
                stats.add_received(HEADER_SIZE + header.length + extra)
                req._finish(None)
        except ProtocolError as exc:  # bad magic or version
            self._fail(ProtocolError(f"from rank {p.rank}: {exc}"))
            req = p.current
            p.current = None
            if req is not None:
                req._finish(self._failure)
        except OSError as exc:
            req = p.current
            p.current = None
            if self._failure is None and not self._closing:
                self._fail(PeerLostError(self._lost_message(p.rank, exc)))
            if req is not None:
                req._finish(self._failure or UsageError("the TCP transport is closed"))
            return
        if not self._closing:
            # Failed: keep reading (and dropping) whatever the peer still sends until it
            # closes, so that a peer blocked writing to this rank is released at once.
            scratch = bytearray(1 << 16)
            with contextlib.suppress(OSError):
                while p.sock.recv_into(scratch):
                    pass

    def _check_tag(self, p: _Peer, head: bytearray, req: _TCPRequest) -> bool:
        """Read and check the integrity tag of the frame just received into ``req`` (for
        ``irecv_consume`` the payload was hashed as it was consumed); False (and the
        transport failed, ``req`` finished) when it does not verify. OSError at EOF."""
        tag = bytearray(FRAME_TAG_BYTES)
        if _recv_exact(p.sock, memoryview(tag)) < FRAME_TAG_BYTES:
            raise ConnectionError("the connection ended inside a frame's integrity tag")
        assert p.key_in is not None
        if req.consume is not None:
            assert p.consume_mac is not None
            want = p.consume_mac.digest(FRAME_TAG_BYTES)
            p.consume_mac = None
        else:
            want = _frame_tag(p.key_in, p.count_in, bytes(head), req.view)
        p.count_in += 1
        if hmac.compare_digest(want, bytes(tag)):
            return True
        p.current = None
        self._fail(ProtocolError(f"rank {self.rank}: a frame from rank {p.rank} failed its "
                                 "integrity check (altered on the way, or not sent by it)"))
        req._finish(self._failure)
        return False

    def _abort_notice(self, p: _Peer, header: FrameHeader, req: _TCPRequest | None,
                      early: int) -> None:
        """``p`` sent an ABORT frame; ``early`` bytes of its reason landed in ``req.view``."""
        n = min(header.length, MAX_REASON_BYTES)
        raw = bytearray(n)
        have = 0
        if req is not None and early > 0:
            have = min(early, n)
            raw[:have] = req.view[:have]
        if have < n:
            have += _recv_exact(p.sock, memoryview(raw)[have:])
        reason = raw[:have].decode("utf-8", errors="replace")
        self._fail(PeerLostError(f"rank {p.rank} aborted: {reason}"))
        if req is not None:
            req._finish(self._failure)

    def _eof(self, p: _Peer, req: _TCPRequest | None, between_frames: bool) -> None:
        """The connection to ``p`` reached end of file (``req``: the frame being read)."""
        if self._failure is None and not self._closing:
            if between_frames and req is None:
                p.eof = True
                if p.recv_q.empty():
                    return  # a clean close: only later calls involving p fail
            self._fail(PeerLostError(self._lost_message(p.rank, None)))
        if req is not None:
            req._finish(self._failure or UsageError("the TCP transport is closed"))

    def _abort_reason(self, peer: int) -> str | None:
        """``"rank <peer> aborted: <reason>"`` when ``peer`` left an abort reason in the
        store, else None."""
        store = self._store
        if store is None:
            return None
        try:
            raw = store.try_get(self._key(KEY_ABORT.format(peer)),
                                time.monotonic() + ABORT_STORE_SECONDS)
        except CommError:
            return None
        if raw is None:
            return None
        return f"rank {peer} aborted: {raw.decode('utf-8', errors='replace')}"

    def _lost_message(self, peer: int, exc: BaseException | None) -> str:
        """Why the connection to ``peer`` ended: its abort reason from the store if any."""
        reason = self._abort_reason(peer)
        if reason is not None:
            return reason
        how = f" ({exc})" if exc is not None else ""
        return (f"lost the connection to rank {peer}{how}: rank {peer} exited, was killed or "
                "closed its transport")

    # ---------------------------------------------------------------- abort / close

    def _drain(self, p: _Peer, error: BitcollError) -> None:
        """Fail every request still queued for ``p`` and wake its threads."""
        drain_peer(p, error)

    def _fail(self, error: CommError, reason: str | None = None) -> None:
        """Record the first failure, tell every peer, stop everything. Never raises."""
        with self._lock:
            if self._failure is not None or self._closed:
                return
            self._failure = error
        text = (str(error) if reason is None else reason).encode("utf-8", errors="replace")
        text = text[:MAX_REASON_BYTES]
        # 1. An ABORT frame on every connection that is between frames (the fast path).
        frame = FrameHeader(seq=0, step=0, signature=0, length=len(text),
                            kind=FrameKind.ABORT).pack() + text
        for p in self._peers.values():
            if p.send_lock.acquire(blocking=False):
                if p.partial:  # the connection is in the middle of a frame
                    p.send_lock.release()
                    continue
                try:
                    with contextlib.suppress(OSError):
                        p.sock.send(frame, _DONTWAIT | _NOSIGNAL)
                finally:
                    p.send_lock.release()
        # 2. The reason in the store, for peers that will only see the stream end mid-frame.
        if self._store is not None:
            with contextlib.suppress(CommError):
                self._store.set(self._key(KEY_ABORT.format(self.rank)), text,
                                time.monotonic() + ABORT_STORE_SECONDS)
        # SHUT_WR: peers read the end of the stream after what was sent (this rank's own
        # blocked sends fail at once); the receiver threads go on reading and dropping data
        # until the peers close, so no peer stays blocked writing to this rank.
        for p in self._peers.values():
            with contextlib.suppress(OSError):
                p.sock.shutdown(socket.SHUT_WR)
        for p in self._peers.values():
            self._drain(p, error)
            current = p.current
            if current is not None:
                current._finish(error)

    def abort(self, reason: str) -> None:
        """Fail every pending and future request here and make every peer fail promptly.

        On this rank ``failure`` becomes ``CommError("rank <r> aborted: <reason>")`` unless an
        earlier error is recorded (that one is kept); peers fail with
        ``PeerLostError("rank <r> aborted: <reason>")``. Idempotent; never raises; a no-op
        after close.
        """
        self._fail(CommError(f"rank {self.rank} aborted: {reason}"), reason)

    def close(self, timeout: float | None = None) -> None:
        """Flush queued sends, close the connections, join the threads. Idempotent.

        ``timeout`` (default: ``close_timeout`` of :meth:`create`) bounds the wait for queued
        sends and, on rank 0, for the other ranks to leave the store (after a failure at most
        :data:`FAILED_CLOSE_SECONDS`). Requests still pending afterwards fail with UsageError.
        Never raises.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        deadline = time.monotonic() + (self.close_timeout if timeout is None else timeout)
        closed = UsageError("the TCP transport is closed")
        for p in self._peers.values():
            p.send_q.put(None)  # senders exit after the frames queued before it
        for p in self._peers.values():
            if p.sender is not None:
                p.sender.join(max(0.0, deadline - time.monotonic()))
        self._closing = True
        for p in self._peers.values():
            with contextlib.suppress(OSError):
                p.sock.shutdown(socket.SHUT_RDWR)
            self._drain(p, closed)
        for p in self._peers.values():
            for t in (p.sender, p.receiver):
                if t is not None:
                    t.join(5.0)
            self._drain(p, closed)
            p.sock.close()
        if self._rdv is not None:
            if self._failure is not None:
                deadline = min(deadline, time.monotonic() + FAILED_CLOSE_SECONDS)
            self._rdv.close(deadline)

    def __enter__(self) -> TCPTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------------------------
# Rendezvous and the handshake
# --------------------------------------------------------------------------------------------


class RendezvousStore(Protocol):
    """What the set-up needs of a store: bitcoll's :class:`StoreClient` or an
    :class:`~bitcoll.transport.external_store.ExternalStore`."""

    def set(self, key: str, value: bytes, deadline: float | None = None) -> None: ...

    def get(self, key: str, deadline: float | None = None) -> bytes: ...

    def try_get(self, key: str, deadline: float | None = None) -> bytes | None: ...

    def add(self, key: str, delta: int, deadline: float | None = None) -> int: ...

    def wait(self, keys: Iterable[str], deadline: float | None = None) -> None: ...

    def missing(self, keys: Iterable[str], deadline: float | None = None) -> list[str]: ...

    def close(self) -> None: ...

    @property
    def local_address(self) -> str: ...


#: Worlds built so far in this process per own-store address and rank: the store's
#: *generation*, so that a rank re-creating a communicator never talks to rank 0's previous
#: store while it closes.
_GENERATIONS: dict[tuple[str, int, int], int] = {}
_GENERATIONS_LOCK = threading.Lock()


class _Rendezvous:
    """A transport's store, its key namespace (``prefix``) and the job's secret.

    ``owns``: the store (and on rank 0 the server) belongs to this transport and is closed with
    it; sub-groups borrow their parent's. ``secret_file``: rank 0's secret file while the other
    ranks may still need to read it.
    """

    def __init__(self, store: RendezvousStore, prefix: str, secret: bytes, where: str,
                 server: StoreServer | None = None, owns: bool = False,
                 secret_file: auth.SecretFile | None = None) -> None:
        self.store = store
        self.prefix = prefix
        self.secret = secret
        self.where = where
        self.server = server
        self.owns = owns
        self.secret_file = secret_file

    def key(self, suffix: str) -> str:
        return self.prefix + suffix

    @classmethod
    def own(cls, rank: int, master_addr: str, master_port: int, secret: bytes | None,
            deadline: float, timeout: float) -> _Rendezvous:
        """bitcoll's store at ``master_addr:master_port``, served by rank 0."""
        with _GENERATIONS_LOCK:
            gen = _GENERATIONS.get((master_addr, master_port, rank), 0)
            _GENERATIONS[(master_addr, master_port, rank)] = gen + 1
        where = f"{master_addr}:{master_port}"
        server: StoreServer | None = None
        secret_file: auth.SecretFile | None = None
        try:
            if rank == 0:
                if secret is None:
                    secret_file = auth.SecretFile()
                    secret = secret_file.secret
                server = StoreServer(master_addr, master_port, secret=secret, generation=gen,
                                     hint="" if secret_file is None else secret_file.path)
            try:
                client = StoreClient.connect(master_addr, master_port, deadline, secret=secret,
                                             generation=gen)
            except CommTimeoutError as exc:
                raise CommTimeoutError(
                    f"rank {rank}: rank 0 never showed up: no rendezvous store answered at "
                    f"{where} within {timeout:g} s ({exc})") from None
        except BaseException:
            if server is not None:
                server.close()
            if secret_file is not None:
                secret_file.remove()
            raise
        return cls(client, "bitcoll/", client.secret, where, server, True, secret_file)

    @classmethod
    def external(cls, rank: int, store: object, master_addr: str, secret: bytes | None,
                 deadline: float) -> _Rendezvous:
        """A store the job already has (torch.distributed's); keys under
        ``bitcoll/<k>/`` where ``k`` counts the worlds this rank built on it."""
        ext = ExternalStore(store, host=getattr(store, "host", None) or master_addr or None)
        gen = ext.add(f"bitcoll/count/{rank}", 1, deadline) - 1
        prefix = f"bitcoll/{gen}/"
        secret_file: auth.SecretFile | None = None
        if secret is None:
            if rank == 0:
                secret_file = auth.SecretFile()
                secret = secret_file.secret
                ext.set(prefix + KEY_SECRET_FILE, secret_file.path.encode(), deadline)
            else:
                path = ext.get(prefix + KEY_SECRET_FILE, deadline)
                secret = auth.read_secret_file(path.decode("utf-8", errors="replace"))
        return cls(ext, prefix, secret, "the job's store", None, True, secret_file)

    def child(self, suffix: str) -> _Rendezvous:
        """The same store and secret under ``prefix + suffix``, not owned."""
        return _Rendezvous(self.store, self.prefix + suffix, self.secret, self.where)

    def forget_secret_file(self) -> None:
        """Remove rank 0's secret file (every rank has read it, or set-up failed)."""
        if self.secret_file is not None:
            self.secret_file.remove()
            self.secret_file = None

    def close(self, server_deadline: float) -> None:
        """Close an owned store; rank 0 serves it until the others left or the deadline."""
        self.forget_secret_file()
        if not self.owns:
            return
        self.store.close()
        if self.server is not None:
            self.server.wait_idle(server_deadline)
            self.server.close()


def _connect(addr: tuple[str, int], deadline: float, peer: int) -> socket.socket:
    """Connect to a published address, retrying refused connections until ``deadline``."""
    delay = 0.01
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise CommTimeoutError(f"could not connect to rank {peer} at {addr[0]}:{addr[1]} "
                                   "before the deadline")
        try:
            infos = socket.getaddrinfo(addr[0], addr[1], type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            raise PeerLostError(f"rank {peer} published an unresolvable address "
                                f"{addr[0]!r}: {exc}") from exc
        family, _, _, _, sockaddr = infos[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        _tune(sock)
        sock.settimeout(min(left, 10.0))
        try:
            sock.connect(sockaddr)
        except OSError:
            sock.close()
            time.sleep(max(0.0, min(delay, deadline - time.monotonic())))
            delay = min(2 * delay, 0.25)
            continue
        return sock


class _Pending:
    """A connection in the handshake: what it waits for and what it has read."""

    __slots__ = ("buf", "need", "nonce_a", "nonce_b", "peer", "stage")

    def __init__(self, peer: int | None, stage: str, need: int, nonce_a: bytes = b"") -> None:
        self.peer = peer  # the rank this side expects (connector) or claims to be (acceptor)
        self.stage = stage  # "accept" (connector waits), "hello" / "confirm" (acceptor waits)
        self.need = need
        self.buf = bytearray()
        self.nonce_a = nonce_a
        self.nonce_b = b""


#: Most handshakes an acceptor runs at once with connections not yet proven (strangers).
MAX_PENDING_HANDSHAKES: Final = 256


class _Mesh:
    """Connects every pair of ranks with the authenticated hello of
    :mod:`bitcoll.transport.handshake`: this rank connects to every higher rank and accepts
    every lower one. Connections that fail the proof are dropped (and logged at debug level)
    on the accepting side and are a ProtocolError on the connecting side."""

    def __init__(self, rank: int, size: int, job_id: int, secret: bytes, mine: str,
                 deadline: float, timeout: float) -> None:
        self.rank = rank
        self.size = size
        self.job_id = job_id
        self.secret = secret
        self.mine = mine  # the address this rank published ("<port> <host>")
        self.deadline = deadline
        self.timeout = timeout
        self.addrs: dict[int, str] = {}
        self.done: dict[int, socket.socket] = {}
        self.pending: dict[socket.socket, _Pending] = {}

    def _proof(self, role: str, a: int, b: int, nonce_a: bytes, nonce_b: bytes,
               addr_b: str) -> bytes:
        return handshake.proof(self.secret, role, self.job_id, self.size, a, b, nonce_a,
                               nonce_b, addr_b)

    def connect(self, listener: socket.socket, addrs: dict[int, str]) -> dict[int, socket.socket]:
        """Run the handshakes until every peer is connected; return ``{peer: socket}``."""
        self.addrs = addrs
        sel = selectors.DefaultSelector()
        ok = False
        try:
            for peer in range(self.rank + 1, self.size):
                port_s, host_s = addrs[peer].split(" ", 1)
                s = _connect((host_s, int(port_s)), self.deadline, peer)
                s.settimeout(max(0.001, self.deadline - time.monotonic()))
                nonce_a = auth.new_nonce()
                s.sendall(handshake.Hello(handshake.KIND_HELLO, self.rank, self.size,
                                          self.job_id, nonce_a).pack())
                s.setblocking(False)
                self.pending[s] = _Pending(peer, "accept", handshake.ACCEPT_SIZE, nonce_a)
                sel.register(s, selectors.EVENT_READ)
            listener.setblocking(False)
            sel.register(listener, selectors.EVENT_READ)
            while len(self.done) < self.size - 1:
                left = self.deadline - time.monotonic()
                if left <= 0:
                    raise self._timed_out()
                for key, _ in sel.select(min(left, 1.0)):
                    obj = key.fileobj
                    assert isinstance(obj, socket.socket)
                    if obj is listener:
                        self._accept(listener, sel)
                    else:
                        self._read(obj, sel)
            ok = True
        finally:
            sel.close()
            if not ok:
                for s in list(self.pending) + list(self.done.values()):
                    s.close()
            else:
                for s in self.pending:
                    s.close()
        for s in self.done.values():
            s.setblocking(True)
            with contextlib.suppress(OSError):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return self.done

    def _timed_out(self) -> CommTimeoutError:
        absent = set(range(self.rank)) - self.done.keys()
        silent = set(range(self.rank + 1, self.size)) - self.done.keys()
        parts = []
        if absent:
            parts.append(f"{_ranks(absent)} never connected")
        if silent:
            parts.append(f"{_ranks(silent)} never answered the handshake")
        return CommTimeoutError(f"rank {self.rank}: {' and '.join(parts)} within "
                                f"{self.timeout:g} s")

    def _accept(self, listener: socket.socket, sel: selectors.BaseSelector) -> None:
        while True:
            try:
                conn, addr = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE and friends: drop nothing, try again later
                _log.debug("rank %d: accept failed during set-up: %s", self.rank, exc)
                return
            if len(self.pending) >= MAX_PENDING_HANDSHAKES:
                _log.debug("rank %d: too many handshakes at once; dropped %s", self.rank, addr)
                conn.close()
                continue
            conn.setblocking(False)
            self.pending[conn] = _Pending(None, "hello", handshake.HELLO_SIZE)
            sel.register(conn, selectors.EVENT_READ)

    def _drop(self, s: socket.socket, sel: selectors.BaseSelector, why: str) -> None:
        p = self.pending.pop(s)
        sel.unregister(s)
        s.close()
        if p.stage == "accept":  # a connection this rank made: the peer is not who it should be
            raise PeerLostError(f"rank {self.rank}: rank {p.peer} {why}")
        _log.debug("rank %d: dropped an incoming connection during set-up: %s", self.rank, why)

    def _read(self, s: socket.socket, sel: selectors.BaseSelector) -> None:
        p = self.pending[s]
        try:
            chunk = s.recv(p.need - len(p.buf))
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._drop(s, sel, f"broke the handshake: {exc}")
            return
        if not chunk:
            self._drop(s, sel, "closed the connection during the handshake")
            return
        p.buf += chunk
        if len(p.buf) < p.need:
            return
        if p.stage == "hello":
            self._on_hello(s, p, sel)
        elif p.stage == "confirm":
            self._on_confirm(s, p, sel)
        else:
            self._on_accept(s, p, sel)

    def _send(self, s: socket.socket, data: bytes) -> bool:
        """Write a handshake message (small: fits the empty socket buffer at once)."""
        try:
            return s.send(data, _NOSIGNAL) == len(data)
        except OSError:
            return False

    def _on_hello(self, s: socket.socket, p: _Pending, sel: selectors.BaseSelector) -> None:
        """Acceptor, message 1 arrived: check it, answer with message 2."""
        h = handshake.Hello.unpack(p.buf)
        if not h.matches(handshake.KIND_HELLO, self.size, self.job_id) or \
                not 0 <= h.rank < self.rank or h.rank in self.done:
            self._drop(s, sel, f"not a lower rank of this job (claims rank {h.rank} of "
                               f"{h.size}, job {h.job_id:#x}, version {h.version})")
            return
        p.peer, p.nonce_a, p.nonce_b = h.rank, h.nonce, auth.new_nonce()
        answer = handshake.Hello(handshake.KIND_ACCEPT, self.rank, self.size, self.job_id,
                                 p.nonce_b).pack()
        answer += self._proof("accept", h.rank, self.rank, p.nonce_a, p.nonce_b, self.mine)
        if not self._send(s, answer):
            self._drop(s, sel, "could not be answered")
            return
        p.stage, p.need, p.buf = "confirm", handshake.CONFIRM_SIZE, bytearray()

    def _on_confirm(self, s: socket.socket, p: _Pending, sel: selectors.BaseSelector) -> None:
        """Acceptor, message 3 arrived: the connector's proof."""
        assert p.peer is not None
        if p.peer in self.done or not handshake.verify(
                self.secret, p.buf, "connect", self.job_id, self.size, p.peer, self.rank,
                p.nonce_a, p.nonce_b, self.mine):
            self._drop(s, sel, f"a connection claiming rank {p.peer} failed the proof of the "
                               "job's secret")
            return
        del self.pending[s]
        sel.unregister(s)
        self.done[p.peer] = s

    def _on_accept(self, s: socket.socket, p: _Pending, sel: selectors.BaseSelector) -> None:
        """Connector, message 2 arrived: the acceptor's identity and proof."""
        assert p.peer is not None
        h = handshake.Hello.unpack(p.buf)
        addr = self.addrs[p.peer]
        good = h.matches(handshake.KIND_ACCEPT, self.size, self.job_id) and \
            h.rank == p.peer and handshake.verify(
                self.secret, p.buf[handshake.HELLO_SIZE:], "accept", self.job_id, self.size,
                self.rank, p.peer, p.nonce_a, h.nonce, addr)
        if not good:
            port_s, host_s = addr.split(" ", 1)
            del self.pending[s]
            sel.unregister(s)
            s.close()
            raise ProtocolError(
                f"rank {self.rank}: the process at {host_s}:{port_s} is not rank {p.peer} of "
                f"this job (it answered as rank {h.rank} of {h.size}, version {h.version}, "
                f"job {h.job_id:#x}, or could not prove it knows the job's secret)")
        confirm = self._proof("connect", self.rank, p.peer, p.nonce_a, h.nonce, addr)
        if not self._send(s, confirm):
            self._drop(s, sel, "closed the connection during the handshake")
            return
        del self.pending[s]
        sel.unregister(s)
        self.done[p.peer] = s
