"""The TCP transport: bitcoll frames over one TCP connection per pair of ranks.

Set-up (:meth:`TCPTransport.create`, the steps live in :mod:`bitcoll.transport.tcp_bootstrap`)
------------------------------------------------------------------------------------------------
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
   logs at debug level with its address (logger ``bitcoll.tcp``), every connection that is not
   a lower rank of this job, fails the proof, takes longer than ``HANDSHAKE_SECONDS`` (5 s) to
   prove itself, or is the oldest unproven one when ``MAX_PENDING_HANDSHAKES`` (256) wait,
   and goes on waiting for the real one; a connector whose connection was dropped before the
   hello completed dials again. For the connector a failed answer is a
   :class:`~bitcoll.errors.ProtocolError`. Every socket gets
   ``TCP_NODELAY``, a send buffer of :data:`SEND_BUFFER_BYTES` (``BITCOLL_SEND_BUFFER``) and a
   receive buffer of at least :data:`RECEIVE_BUFFER_BYTES`. Rank 0 then removes
   its secret file (every rank has proven it read it).

:meth:`TCPTransport.subgroup` repeats steps 1 (through the same store, under a new
namespace) to 3 for a subset of the ranks: sub-communicators get connections of their own, so
their frames can never mix with the parent's or a sibling's.

A rank whose peers do not all show up before the deadline raises
:class:`~bitcoll.errors.CommTimeoutError` naming them. ``size == 1`` needs no store and no
socket. The frame layout is in :mod:`bitcoll.transport.wire`.

Per-peer state machine
----------------------
Every connection is a :class:`_Peer`, a :class:`~bitcoll.transport.peer.PeerLink` whose
lifecycle is a :class:`~bitcoll.transport.peer.PeerState` (``OPEN``, ``PEER_CLOSED``,
``FAILED``, ``CLOSED``; the diagram and the rules are in :mod:`bitcoll.transport.peer`),
changed only by ``PeerLink.transition`` with the peer's ``lock`` held. Here ``PEER_CLOSED``
means the peer closed the connection cleanly between frames while nothing was posted from it;
in ``FAILED`` the peer's helper thread reads and drops whatever the peer still sends until it
closes, so no peer stays blocked writing to this rank; ``CLOSED``: :meth:`TCPTransport.close`
shut the connection down.

The receiving side of an open connection is a second, finer machine (:class:`RxPhase`),
advanced only by whoever holds the peer's *reader token* (``rx``, a lock) in
:meth:`TCPTransport._advance`::

    HEADER ──(data header, nothing posted)──► HELD ──(receive posted)──┐
      │  └──(data header, receive posted)─────────────────────────────┴──► BODY ──► TAG ──┐
      │                                                                         │          │
      ▲─────────────────────────── frame complete: request finished ◄───────────┴──────────┘

(TAG only with a trailer: the frame integrity tag, or else the checksum.) An ABORT header, a
mismatched header, end of file or a socket error leaves the machine through the failure path
instead.

Progress
--------
*Small messages progress on the calling thread.* ``isend`` writes what the socket takes at
once (``MSG_DONTWAIT``) when nothing is queued to that peer; ``irecv`` posts the receive and
reads whatever has already arrived; ``Request.wait`` of a receive takes the reader tokens
itself and polls the sockets (all peers', so an abort notice or a lost connection from any
peer ends the wait at once) until its frame is complete: an exchange of small frames wakes no
other thread.

*Helper threads only where they overlap work.* Per peer, a *sender* thread finishes sends that
did not fit the socket at once (large frames; order is kept: a send queues behind any send
ahead of it), and a *receiver* thread serves receives of at least
:data:`HELPER_RECEIVE_BYTES`, plain or consumed piece by piece
(:meth:`TCPTransport.irecv_consume`: a reduction runs while the caller computes), reading
straight into the caller's buffer (``MSG_WAITALL``); a smaller consumed frame is read whole
into a per-peer buffer and consumed by whichever thread completes it. A
caller that must block on something it cannot drive itself (a send still being written, a
receive a helper serves) first hands every posted receive to the helpers, so no two ranks can
wait on each other's unread data. Nothing is pickled; payloads are never copied in user space.

*Streams: a large ring pass in native code.* :meth:`TCPTransport.stream` runs a whole
:class:`~bitcoll.transport.base.StreamPlan` (the frames a rank sends to its right neighbour and
receives from its left one in a ring all-reduce, with the folds and the forwarding between
them) in :func:`bitcoll.kernels.stream.run_stream`: one ``poll`` loop on the calling thread,
compiled, without the GIL, with no helper thread and no Python per frame. The frames on the
wire are the same as those of the frame-by-frame path. It runs only on connections that are
idle at that moment (nothing queued to the right neighbour, nothing posted or partly read from
the left one, frame integrity off) and otherwise declines, and the caller makes the frames one
by one. Every way a stream ends early fails the transport through the one failure path below,
also a timeout (half-done frames cannot be resumed). While it runs, the other connections are
watched: data arriving on one (an abort notice) hands control back to read it.

Checksum
--------
Unless frame integrity is on (its keyed tag covers this and more), every data frame carries
the CRC32C of its header and payload after the payload (:mod:`bitcoll.kernels.checksum`,
:data:`~bitcoll.kernels.checksum.CHECKSUM_BYTES` bytes, little-endian), checked on arrival: a
frame altered on the way (a faulty NIC, switch, cable or memory: TCP's own 16-bit checksum
lets some through) is a :class:`~bitcoll.errors.ProtocolError` naming the link, on the
receiving rank and, through the failure path, on every rank; no result is delivered. On by
default; ``checksum=False`` (``BITCOLL_CHECKSUM=0``) leaves it out, and an altered frame is
then delivered as it arrived. Every rank must use the same setting (a rank that differs
refuses to join). Streams checksum the bytes as they pass (:mod:`bitcoll.kernels.stream`); the
frame path checksums a send's payload when it is submitted and a receive's when it is
complete (consumed receives piece by piece). Abort notices carry no checksum.

Traffic counters
----------------
:attr:`TCPTransport.stats` counts frames: one message and ``HEADER_SIZE + payload length``
bytes per frame (plus the integrity tag or the checksum when on), exactly the bytes written to
/ read from the socket for it. A send is counted when the kernel has taken all of it, a
receive when it is complete. The handshake, abort notices and the rendezvous store's traffic
are not counted.

Failure
-------
* A header that differs from the expected one fails that receive with
  :class:`~bitcoll.errors.ProtocolError` (message from :meth:`FrameHeader.mismatch`) and
  aborts the transport.
* A connection that breaks while a frame is in flight or a receive from that peer is posted
  (end of file, reset, write error) fails the transport with
  :class:`~bitcoll.errors.PeerLostError` naming the peer; when the peer left an abort reason in
  the store the message is ``"rank <p> aborted: <reason>"``. A connection closed cleanly
  between frames while nothing is posted from that peer moves it to ``PEER_CLOSED`` only.
* :meth:`TCPTransport.abort` (also run on every internal failure) records the error, sends an
  ABORT frame (tagged with frame integrity on: :mod:`bitcoll.transport.wire`; an ABORT frame
  whose tag does not verify is a ProtocolError naming the link and its text is not shown) to
  every peer whose connection is between frames, writes the reason (with integrity on, with a
  proof of the job's secret) under
  ``bitcoll/abort/<rank>`` in the store (for the peers whose connection was in the middle of a
  frame), then shuts down the sending side of every connection (a send blocked in the kernel
  fails at once). Peers fail within milliseconds with ``PeerLostError("rank <r> aborted:
  <reason>")``. The buffer of a failed receive may still be written into until
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
import enum
import errno
import hmac
import logging
import os
import select
import socket
import threading
import time
from typing import Any, Final, NamedTuple

import numpy as np

from ...config import DEFAULT_TIMEOUT, ENV_CHECKSUM, switch
from ...errors import (
    BitcollError,
    CommError,
    CommTimeoutError,
    PeerLostError,
    ProtocolError,
    UsageError,
)
from ...kernels import stream as stream_kernel
from ...kernels.checksum import CHECKSUM_BYTES, crc32c, crc32c_raw, frame_checksum
from ...kernels.stream import Status as StreamStatus
from ..base import (
    HEADER_SIZE,
    Consumer,
    FrameHeader,
    FrameKind,
    Request,
    StreamPlan,
    TrafficStats,
    byte_view,
)
from ..netio import DONTWAIT, NOSIGNAL, WAITALL, recv_exact, send_all_parts, send_some
from ..peer import HELPER_RECEIVE_BYTES as HELPER_RECEIVE_BYTES
from ..peer import SPIN_SECONDS as SPIN_SECONDS
from ..peer import (
    ConsumerFailed,
    FrameRequest,
    LinkTransport,
    PeerLink,
    PeerState,
    Want,
    timeout_error,
)
from ..rendezvous import auth
from ..rendezvous.external_store import check_store
from ..rendezvous.tcp_bootstrap import KEY_ABORT as KEY_ABORT
from ..rendezvous.tcp_bootstrap import KEY_ADDR as KEY_ADDR
from ..rendezvous.tcp_bootstrap import KEY_INTEGRITY as KEY_INTEGRITY
from ..rendezvous.tcp_bootstrap import KEY_JOB as KEY_JOB
from ..rendezvous.tcp_bootstrap import KEY_SIZE as KEY_SIZE
from ..rendezvous.tcp_bootstrap import KEY_STALL as KEY_STALL
from ..rendezvous.tcp_bootstrap import RECEIVE_BUFFER_BYTES as RECEIVE_BUFFER_BYTES
from ..rendezvous.tcp_bootstrap import SEND_BUFFER_BYTES as SEND_BUFFER_BYTES
from ..rendezvous.tcp_bootstrap import RendezvousStore as RendezvousStore
from ..rendezvous.tcp_bootstrap import _Mesh as _Mesh
from ..rendezvous.tcp_bootstrap import _Rendezvous as _Rendezvous
from ..rendezvous.tcp_bootstrap import build_mesh, send_buffer_bytes
from ..wire import FRAME_TAG_BYTES as FRAME_TAG_BYTES
from ..wire import MAX_REASON_BYTES as MAX_REASON_BYTES
from ..wire import abort_frame, blake3_module, decode_reason, frame_tag, tag_hasher

__all__ = ["TCPTransport", "SEND_BUFFER_BYTES", "RECEIVE_BUFFER_BYTES", "PeerState", "RxPhase",
           "checksum_setting"]

#: Piece size of :meth:`TCPTransport.irecv_consume`: small enough to stay in a core's L2
#: cache between the kernel's copy and the consumer's read.
CONSUME_CHUNK_BYTES: Final = 256 << 10
#: A checksummed send of at least this many payload bytes writes its payload first and
#: computes the checksum while the payload drains to the wire (the trailer follows); smaller
#: ones compute it first, so header, payload and trailer leave in one system call. Below
#: 1 MiB the trailer's own system call and the receiver's extra wake-up for it cost more CPU
#: than the checksum they hide (the sign all-reduce on the 10 Gbit testbed: about 9 us per
#: 64 KiB frame, 45 us per 256 KiB frame; results/checksum/late_threshold/).
LATE_CHECKSUM_BYTES: Final = 1 << 20
#: How long an abort spends at most writing its reason into the store.
ABORT_STORE_SECONDS: Final = 0.5
#: Default of ``close_timeout``: how long ``close()`` waits for queued sends and for the
#: other ranks to leave rank 0's store.
CLOSE_TIMEOUT: Final = 30.0
#: After a failure rank 0 keeps its store at most this long for peers to read abort reasons.
FAILED_CLOSE_SECONDS: Final = 2.0
#: A caller blocked on a request it does not drive itself looks at the idle connections
#: (abort notices, lost peers) this often.
IDLE_LOOK_SECONDS: Final = 0.05
#: How long a rank that timed out waits for the ranks it waited on to report whom they
#: waited on (see :meth:`TCPTransport.silent_origin`): :data:`STALL_GRACE_FRACTION` of the
#: time it waited, from :data:`STALL_GRACE_MIN_SECONDS` to :data:`STALL_GRACE_SECONDS`
#: (the ranks of one collective time out within about the same time of each other, so a
#: peer that is itself waiting reports soon; a stopped peer never does, and the error comes
#: that much after the deadline: 0.5 s for a 10 s timeout). And how often it looks.
STALL_GRACE_SECONDS: Final = 2.0
STALL_GRACE_MIN_SECONDS: Final = 0.5
STALL_GRACE_FRACTION: Final = 0.05
STALL_POLL_SECONDS: Final = 0.02

#: The kernel's fold codes of the ops a stream may carry.
_STREAM_OPS: Final = {"sum": stream_kernel.OP_SUM, "max": stream_kernel.OP_MAX,
                      "min": stream_kernel.OP_MIN}

_log = logging.getLogger("bitcoll.tcp")

_POLL_IN: Final = select.POLLIN | select.POLLPRI | select.POLLERR | select.POLLHUP


def checksum_setting(value: bool | None = None) -> bool:
    """Whether data frames carry a checksum: ``value`` when True or False, else
    ``BITCOLL_CHECKSUM`` ("0" or "1"; unset: on). UsageError for anything else."""
    return switch(value, "checksum", ENV_CHECKSUM, True)


class RxPhase(enum.Enum):
    """Where the receiving side of an open connection is within the byte stream."""

    HEADER = "header"  # reading a frame header (``rx_got`` bytes of it so far)
    HELD = "held"  # a data header was read; no receive is posted for it yet
    BODY = "body"  # reading the payload into the oldest posted receive
    TAG = "tag"  # reading the frame's trailer: integrity tag or checksum


class _StreamEnd(NamedTuple):
    """How a stream's loop ended (:meth:`TCPTransport._run_stream`)."""

    status: int  # a kernels.stream.Status, or -1: past the deadline
    sent: int  # frames sent completely
    sdone: int  # bytes of the next frame sent (a frame half written)
    received: int  # frames received completely
    started: float  # time.monotonic() when the stream began


class _TCPRequest(FrameRequest):
    """A pending send or receive of one frame. ``wait`` of a receive drives the connections
    itself (:meth:`TCPTransport._drive`); ``wait`` of a send first hands the posted receives
    to the receiver threads."""

    __slots__ = ("head", "late", "sent", "tail")

    def __init__(self, owner: TCPTransport, peer: int, header: FrameHeader, view: memoryview,
                 is_send: bool) -> None:
        super().__init__(owner, peer, header, view, is_send)
        self.head = header.pack() if is_send else b""
        self.tail = b""  # the frame's trailer (sends): integrity tag or checksum
        self.sent = 0  # bytes of a send already written by isend itself
        self.late = False  # a send whose checksum is still to be computed (``tail`` empty)

    def parts(self) -> list[bytes | memoryview]:
        """What a send writes: header, payload, tag (empty pieces left out)."""
        out: list[bytes | memoryview] = [self.head]
        if len(self.view):
            out.append(self.view)
        if self.tail:
            out.append(self.tail)
        return out


class _Peer(PeerLink[_TCPRequest]):
    """One connection: the shared :class:`~bitcoll.transport.peer.PeerLink` (state, send
    queue, posted receives, reader token) plus its socket, the :class:`RxPhase` machine and
    frame integrity. ``lock`` also guards ``partial``; the reader-token holder owns every
    ``rx_*`` field."""

    def __init__(self, rank: int, sock: socket.socket, trailer: int) -> None:
        super().__init__(rank)
        self.sock = sock
        self.fd = sock.fileno()
        self.partial = False  # the connection is in the middle of a frame written by isend
        # A stream holds the sending side (``lock`` guards both): the failure path leaves its
        # abort notice here for the stream to write, then shut the side down.
        self.streaming = False
        self.notice: bytes | None = None
        self.rx_phase = RxPhase.HEADER
        self.rx_got = 0
        self.rx_header: FrameHeader | None = None
        self.hbuf = bytearray(HEADER_SIZE)
        self.hview = memoryview(self.hbuf)
        self.tag = bytearray(FRAME_TAG_BYTES)
        self.tview = memoryview(self.tag)[:trailer]  # where a data frame's trailer is read
        self.bounce = memoryview(bytearray(CONSUME_CHUNK_BYTES))  # irecv_consume's buffer
        # Frame integrity (None when off): keys and frame counters of each direction; the
        # MAC lock keeps outgoing counters in isend order.
        self.key_out: bytes | None = None
        self.key_in: bytes | None = None
        self.count_out = 0
        self.count_in = 0
        self.count_sent = 0  # frames written completely (``send_lock``): an abort's number
        self.mac_lock = threading.Lock()
        self.rx_mac: Any = None  # the tag hasher of the frame being consumed
        self.rx_sum = -1  # the checksum so far of the frame being received (-1: none)


# --------------------------------------------------------------------------------------------
# The transport
# --------------------------------------------------------------------------------------------


class TCPTransport(LinkTransport):
    """Frames between the ranks of one job over TCP. Build it with :meth:`create`."""

    name = "tcp"
    _links: list[_Peer]

    def __init__(self, rank: int, size: int, socks: dict[int, socket.socket],
                 rendezvous: _Rendezvous | None, job_id: int,
                 close_timeout: float = CLOSE_TIMEOUT, integrity: bool = False,
                 send_buffer: int = SEND_BUFFER_BYTES, checksum: bool | None = None) -> None:
        """Wrap established connections (use :meth:`create` instead). ``checksum``: see
        :meth:`create` (None: :func:`checksum_setting`)."""
        self.rank = rank
        self.send_buffer = send_buffer  # the connections' SO_SNDBUF (sub-groups' too)
        self.size = size
        self.stats = TrafficStats()
        self.job_id = job_id
        self.integrity = integrity
        #: Whether this rank's host runs more ranks than this process has cores (set by
        #: ``bitcoll.init`` once the topology is known): waits for frames and streams then
        #: block in ``poll`` at once instead of looking for :data:`SPIN_SECONDS` first.
        self.oversubscribed = False
        #: Whether data frames carry a CRC32C (never with integrity: its tag covers it).
        self.checksum = checksum_setting(checksum) and not integrity
        # Bytes after each data frame's payload: the tag, the checksum or nothing.
        self._trailer = FRAME_TAG_BYTES if integrity else \
            CHECKSUM_BYTES if self.checksum else 0
        self.frame_overhead = HEADER_SIZE + self._trailer
        self.close_timeout = close_timeout
        self._rdv = rendezvous
        self._store: RendezvousStore | None = None if rendezvous is None else rendezvous.store
        self._groups = 0  # sub-groups made so far (their key namespaces)
        self._init_links(pipe=bool(socks))
        self._peers: dict[int, _Peer] = {p: _Peer(p, s, self._trailer)
                                           for p, s in socks.items()}
        if integrity and rendezvous is not None:
            for peer in self._peers.values():
                peer.key_out = auth.mac(rendezvous.secret, "frame-key", job_id, rank, peer.rank)
                peer.key_in = auth.mac(rendezvous.secret, "frame-key", job_id, peer.rank, rank)
        self._start_links(list(self._peers.values()), "tcp")

    # ---------------------------------------------------------------- set-up

    @classmethod
    def create(cls, rank: int, size: int, master_addr: str, master_port: int,
               timeout: float = DEFAULT_TIMEOUT, listen_addr: str | None = None, *,
               store: object | None = None, integrity: bool = False,
               close_timeout: float = CLOSE_TIMEOUT,
               send_buffer: int | None = None,
               checksum: bool | None = None) -> TCPTransport:
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
        ``checksum`` (default: ``BITCOLL_CHECKSUM``, else on; off where ``integrity`` is on,
        whose tag covers it): every data frame carries the CRC32C of its header and payload,
        checked on arrival: a frame altered on the way is a ProtocolError naming the link
        (every rank must pass the same value; a rank that differs refuses to join).
        ``close_timeout``: see :meth:`close`. ``send_buffer``: the SO_SNDBUF of the data
        connections in bytes, 0 for the kernel's sizing (default: ``BITCOLL_SEND_BUFFER``,
        else :data:`SEND_BUFFER_BYTES`); a rank whose value (or variable) is bad refuses to
        join, so the others fail at once too (PeerLostError naming it).

        Raises UsageError for bad arguments, a bad send buffer, a world size
        that differs from rank 0's, a rank
        claimed twice, a secret that cannot be had or is too weak (see
        :func:`bitcoll.transport.auth.check_secret`: ``integrity`` with
        ``BITCOLL_INSECURE=1``; a ``BITCOLL_SECRET`` under 128 bits when the rendezvous
        address is not a loopback one, unless ``BITCOLL_WEAK_SECRET=1``);
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
            auth.check_secret(auth.env_secret(), False, True)  # not with BITCOLL_INSECURE=1
        checked = checksum_setting(checksum)
        refusal = None
        try:
            send = send_buffer_bytes(send_buffer)
        except UsageError as exc:
            if size == 1:
                raise
            refusal, send = f"rank {rank}: {exc}", 0  # told to the others at the rendezvous
        if size == 1:
            return cls(0, 1, {}, None, 0, close_timeout, checksum=checked)
        if store is None and not 0 < master_port < 65536:
            raise UsageError(f"master_port must be in 1..65535, got {master_port}")
        deadline = time.monotonic() + timeout
        secret = auth.env_secret()
        store_host = master_addr if store is None else \
            str(getattr(store, "host", None) or master_addr)
        auth.check_secret(secret, not auth.is_loopback(store_host), integrity)
        try:
            rdv = (_Rendezvous.own(rank, master_addr, master_port, secret, deadline, timeout)
                   if store is None else
                   _Rendezvous.external(rank, store, master_addr, secret, deadline))
        except CommError as exc:
            if refusal is None:
                raise
            raise UsageError(refusal) from exc  # the store was not there to be told
        try:
            socks, job_id = build_mesh(rank, size, rdv, deadline, timeout, listen_addr,
                                       integrity, send, refusal,
                                       checksum=checked and not integrity)
            return cls(rank, size, socks, rdv, job_id, close_timeout, integrity, send, checked)
        except BaseException as exc:
            rdv.close(min(deadline, time.monotonic()) + FAILED_CLOSE_SECONDS)
            if refusal is not None and isinstance(exc, CommError):
                raise UsageError(refusal) from exc  # this rank's own error comes first
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
            return TCPTransport(0, 1, {}, None, 0, self.close_timeout, checksum=self.checksum)
        deadline = time.monotonic() + timeout
        rdv = self._rdv.child(f"group/{tag}/")
        socks, job_id = build_mesh(members.index(self.rank), len(members), rdv, deadline,
                                   timeout, None, self.integrity, self.send_buffer,
                                   checksum=self.checksum)
        return TCPTransport(members.index(self.rank), len(members), socks, rdv, job_id,
                            self.close_timeout, self.integrity, self.send_buffer,
                            self.checksum)

    # ---------------------------------------------------------------- state

    def _key(self, suffix: str) -> str:
        assert self._rdv is not None
        return self._rdv.key(suffix)

    def peer_state(self, peer: int) -> PeerState:
        """The :class:`PeerState` of the connection to ``peer`` (UsageError for a rank that is
        not another rank of this transport)."""
        p = self._peers.get(peer)
        if p is None:
            raise UsageError(f"peer {peer} is not another rank of this {self.size}-rank "
                             f"transport (this is rank {self.rank})")
        return p.state

    def _check_usable(self, peer: int) -> _Peer:
        self._check_open()
        p = self._peers.get(peer)
        if p is None:
            raise UsageError(f"peer {peer} is not another rank of this {self.size}-rank "
                             f"transport (this is rank {self.rank})")
        if p.state is PeerState.PEER_CLOSED:
            self._peer_gone(p)
        return p

    def _peer_gone(self, p: _Peer) -> None:
        """A call involves a peer that closed its connection: fail and raise."""
        error = PeerLostError(self._lost_message(p.rank, None), rank=self.rank, peer=p.rank)
        self._fail(error)
        raise (self._failure or error).with_traceback(None)

    # ---------------------------------------------------------------- sends

    def isend(self, peer: int, payload: memoryview, header: FrameHeader) -> Request:
        """Send ``header`` + ``payload`` to ``peer``; return at once.

        ``payload`` (any C-contiguous buffer) must stay alive and unmodified until the request
        completes; ``header.length`` must equal its size in bytes (UsageError otherwise).
        Raises the transport's failure after an abort, PeerLostError (and aborts) when the
        peer has closed its connection, UsageError after close or for a bad peer.
        """
        p = self._check_usable(peer)
        mv = self._payload(payload, header, writable=False)
        req = _TCPRequest(self, peer, header, mv, True)
        if p.key_out is None:
            if self.checksum:
                if len(mv) >= LATE_CHECKSUM_BYTES:
                    req.late = True  # computed once the payload is on its way
                else:
                    req.tail = frame_checksum(req.head, mv)
            self._submit(p, req)
        else:
            with p.mac_lock:  # counters in submission order
                req.tail = frame_tag(p.key_out, p.count_out, req.head, mv)
                p.count_out += 1
                self._submit(p, req)
        self._fail_late(p)
        return req

    def _submit(self, p: _Peer, req: _TCPRequest) -> None:
        # Nothing queued or being written to this peer: write the frame right here (no
        # thread woken).
        if not p.claim_send():
            self._late_checksum(req)
            p.send_q.put(req)
            return
        try:
            self._send_inline(p, req)
        finally:
            p.send_lock.release()

    def _send_inline(self, p: _Peer, req: _TCPRequest) -> None:
        """Write what the socket takes without blocking; queue the rest for the sender thread.
        Precondition: ``p.send_lock`` held, nothing queued to ``p``."""
        if self._failure is not None:
            req._finish(self._failure)
            return
        parts = req.parts()
        try:
            sent = send_some(p.sock, parts, NOSIGNAL | DONTWAIT)
            if req.late:
                # Header and payload (what the socket took of them) are on their way: the
                # checksum is computed while they drain, then the trailer follows.
                self._late_checksum(req)
                if sent == HEADER_SIZE + len(req.view):
                    sent += send_some(p.sock, [req.tail], NOSIGNAL | DONTWAIT)
        except OSError as exc:
            req._finish(self._os_error(p, exc))
            return
        total = HEADER_SIZE + len(req.view) + len(req.tail)
        if sent == total:
            p.count_sent += 1
            self.stats.add_sent(total)
            req._finish(None)
            return
        req.sent = sent
        with p.lock:
            p.partial = sent > 0
            p.queued += 1
        p.send_q.put(req)

    @staticmethod
    def _late_checksum(req: _TCPRequest) -> None:
        """Compute the trailer of a send whose checksum was left for later (``req.late``)."""
        if req.late:
            req.tail = frame_checksum(req.head, req.view)
            req.late = False

    def _write_queued(self, p: _Peer, req: _TCPRequest) -> BitcollError | None:
        """The sender thread's part (``LinkTransport._send_loop``): finish a frame ``isend``
        could not write at once."""
        try:
            send_all_parts(p.sock, req.parts(), req.sent)
            p.count_sent += 1
        except OSError as exc:
            return self._os_error(p, exc)
        finally:
            with p.lock:
                p.partial = False
        self.stats.add_sent(HEADER_SIZE + len(req.view) + len(req.tail))
        return None

    # ---------------------------------------------------------------- receives

    def irecv(self, peer: int, payload: memoryview, header: FrameHeader) -> Request:
        """Post a receive of the next frame from ``peer`` into ``payload``; return at once
        (after reading what has already arrived).

        ``payload`` (writable, C-contiguous) must hold exactly ``header.length`` bytes
        (UsageError otherwise) and stay alive until the request completes. The request fails
        with ProtocolError (and aborts the transport) when the frame's header differs from
        ``header``. Raises like :meth:`isend`.
        """
        p = self._check_usable(peer)
        mv = byte_view(payload, writable=True, what="payload")
        return self._post_receive(p, header, mv.nbytes, mv, None)

    consumes_on_receive = True

    def irecv_consume(self, peer: int, nbytes: int, header: FrameHeader,
                      consume: Consumer) -> Request:
        """Post a receive of the next frame from ``peer`` whose ``nbytes`` of payload are read
        into a small per-peer buffer, :data:`CONSUME_CHUNK_BYTES` at a time, and handed to
        ``consume(offset, chunk)`` (see :meth:`Transport.irecv_consume`): by the receiver
        thread from :data:`HELPER_RECEIVE_BYTES` up, otherwise in one piece by the thread that
        completes the frame (usually the one waiting for it). Raises like :meth:`irecv`."""
        return self._post_receive(self._check_usable(peer), header, nbytes, memoryview(b""),
                                  consume)

    def _post_receive(self, p: _Peer, header: FrameHeader, nbytes: int, view: memoryview,
                      consume: Consumer | None) -> _TCPRequest:
        """Post a receive (checks shared by both irecv forms), then make progress on it."""
        self._check_length(header, nbytes)
        req = _TCPRequest(self, p.rank, header, view, False)
        req.consume = consume
        req.helper = nbytes >= HELPER_RECEIVE_BYTES
        with p.lock:
            gone = p.state is PeerState.PEER_CLOSED
            if not gone:
                p.posted.append(req)
        if gone:
            self._peer_gone(p)
        self._start_receive(p, req)  # (a closed connection shows at once too)
        failure = self._failure
        if isinstance(failure, PeerLostError) and failure.peer == p.rank:
            raise failure.with_traceback(None)
        return req

    def _timeout_for(self, req: _TCPRequest) -> CommTimeoutError:
        return timeout_error(self.rank, req,
                             self.silent_origin(req.peer, time.monotonic() - req.posted))

    def _drive(self, req: _TCPRequest, deadline: float) -> None:
        """Make progress on the calling thread until ``req`` (a receive) completes, the
        transport fails or ``deadline`` passes: read every connection whose reader token is
        free, poll them (and the wake pipe) when nothing can be read. Returns without
        completing ``req`` when its connection is served by the receiver thread (the caller
        then blocks on the request, looking at the idle connections every
        :data:`IDLE_LOOK_SECONDS`)."""
        target = self._peers[req.peer]
        wants: dict[_Peer, Want] = {}
        ready: list[_Peer] = [target] + [p for p in self._links if p is not target]
        poller: Any = None
        registered: set[int] = set()
        while not req._done and self._failure is None:
            for p in ready:
                if p.state is not PeerState.OPEN or not p.rx.acquire(blocking=False):
                    wants.pop(p, None)  # closed, or served by another thread for now
                    continue
                try:
                    wants[p] = self._advance(p, blocking=False)
                finally:
                    p.rx.release()
            if req.done() or self._failure is not None:
                return
            left = deadline - time.monotonic()
            if left <= 0:
                return
            if wants.get(target) is not Want.READ:
                # The receiver thread (or another thread) has the target connection: block
                # on the request, looking at the idle connections now and then.
                self.hand_over()
                if req._lock.acquire(timeout=min(left, IDLE_LOOK_SECONDS)):
                    req._lock.release()
                    return
                ready = self._links
                continue
            if poller is None:
                poller = select.poll()
                poller.register(self._wake_r, _POLL_IN)
            polled = {p.fd: p for p, w in wants.items()
                      if w is Want.READ and p.state is PeerState.OPEN}
            for fd in registered - polled.keys():
                poller.unregister(fd)
            for fd in polled.keys() - registered:
                poller.register(fd, _POLL_IN)
            registered = set(polled)
            # A reply to a small frame usually comes within microseconds: look without
            # sleeping for a moment (waking from poll costs a reschedule), then block; at
            # once where this host runs more ranks than it has cores (spinning there keeps
            # the awaited rank off the core: 3 and 4 ranks on 2 cores took 1.2-1.3x longer
            # for a small recursive-doubling all-reduce).
            events = poller.poll(0)
            spin_end = time.monotonic() + self._spin_seconds
            while not events and time.monotonic() < spin_end:
                events = poller.poll(0)
            if not events:
                events = poller.poll(max(1, int(min(left, IDLE_LOOK_SECONDS) * 1000) + 1))
            ready = [polled[fd] for fd, _ in events if fd in polled]

    @property
    def _spin_seconds(self) -> float:
        """How long a wait for small frames looks without sleeping before it blocks in
        ``poll``: :data:`SPIN_SECONDS`, not at all where :attr:`oversubscribed`."""
        return 0.0 if self.oversubscribed else SPIN_SECONDS

    # ---------------------------------------------------------------- streams

    streams = stream_kernel.AVAILABLE

    def stream_folds(self, dtype: np.dtype[Any], op: str) -> bool:
        """The native kernel's folds: sums of :data:`~bitcoll.kernels.stream.STREAM_DTYPES`
        (every dtype but float16, which has no native arithmetic), max and min of integers
        (a float max/min would have to match numpy's NaN rules)."""
        return dtype in stream_kernel.STREAM_DTYPES and (op == "sum" or dtype.kind in "iu")

    def stream(self, out_peer: int, in_peer: int, plan: StreamPlan, deadline: float) -> bool:
        """Run ``plan`` (see :meth:`Transport.stream`) in :func:`bitcoll.kernels.run_stream`:
        one poll loop on the calling thread, in native code without the GIL, over the two
        connections (no helper thread, no Python per frame). A stream that receives at most
        :data:`HELPER_RECEIVE_BYTES` looks for its frames without sleeping for
        :data:`SPIN_SECONDS` before each block in ``poll``, yielding the core between looks
        (not where :attr:`oversubscribed`).

        Declines (False, nothing sent or received) when frame integrity is on, a frame is
        queued or being written to ``out_peer``, a receive is posted from ``in_peer`` or its
        next frame is partly read, another thread is reading it, or its next header, read
        ahead already, is not the plan's first. Raises like ``Request.wait``: the transport's
        failure, PeerLostError (end of file, a socket error, an abort notice), ProtocolError
        (a header that differs from the expected one), CommTimeoutError past ``deadline``.
        Unlike a request's wait, every error fails the transport (a stream cannot be resumed
        half way: it has no request per frame to leave pending)."""
        if self.integrity or (not plan.sends and not plan.recvs):
            return False
        out_p = self._check_usable(out_peer)
        in_p = self._check_usable(in_peer)
        if not out_p.send_lock.acquire(blocking=False):
            return False
        sending = True
        try:
            with out_p.lock:
                if out_p.queued:
                    return False
                out_p.streaming = True
            end: _StreamEnd | None = None
            try:
                if not in_p.rx.acquire(blocking=False):
                    return False
                try:
                    end = self._run_stream(out_p, in_p, plan, deadline)
                    if end is None or end.status == StreamStatus.DONE:
                        return end is not None
                    self._stream_over(out_p, end.sdone > 0)
                    # The failure path writes abort notices: let it have the sending side.
                    out_p.send_lock.release()
                    sending = False
                    raise self._stream_error(end, out_p, in_p, plan)
                finally:
                    in_p.rx.release()
            finally:
                if sending:
                    self._stream_over(out_p, end is not None and end.sdone > 0)
        finally:
            if sending:
                out_p.send_lock.release()

    def _stream_over(self, p: _Peer, mid_frame: bool) -> None:
        """A stream gives back ``p``'s sending side (its send lock held): a half-written frame
        gets no abort notice after it; a notice the failure path left for it is written
        (between frames) and the side shut down, that connection's share of the failure
        path."""
        with p.lock:
            p.streaming = False
            p.partial = p.partial or mid_frame
            notice, p.notice = p.notice, None
        if notice is not None:
            with contextlib.suppress(OSError):
                if not mid_frame:
                    p.sock.send(notice, DONTWAIT | NOSIGNAL)
                p.sock.shutdown(socket.SHUT_WR)

    def _run_stream(self, out_p: _Peer, in_p: _Peer, plan: StreamPlan,
                    deadline: float) -> _StreamEnd | None:
        """:meth:`stream` with ``out_p``'s send lock and ``in_p``'s reader token held: None
        when it declines, else how it ended (DONE, a status that needs the failure path, or
        -1 past the deadline)."""
        if in_p.posted or in_p.rx_got or in_p.rx_phase not in (RxPhase.HEADER, RxPhase.HELD):
            return None
        work, src = plan.work, plan.src
        ns, nr = len(plan.sends), len(plan.recvs)
        s_head = np.empty((ns, HEADER_SIZE), np.uint8)
        s_off = np.empty(ns, np.int64)
        s_len = np.empty(ns, np.int64)
        s_src = np.empty(ns, np.int64)
        s_after = np.empty(ns, np.int64)
        s_total = r_total = 0  # elements (Python sums: a numpy sum costs a small stream 0.7 us)
        for i, (header, start, stop, from_src, after) in enumerate(plan.sends):
            if after >= 0 and (from_src or plan.recvs[after][1:3] != (start, stop)):
                raise UsageError(f"stream send {i} forwards receive {after} but is not "
                                 "the same elements of work")
            header.pack_into(s_head[i].data)
            s_off[i], s_len[i], s_src[i], s_after[i] = start, stop - start, from_src, after
            s_total += stop - start
        r_head = np.empty((nr, HEADER_SIZE), np.uint8)
        r_off = np.empty(nr, np.int64)
        r_len = np.empty(nr, np.int64)
        r_mode = np.empty(nr, np.int64)
        for j, (header, start, stop, mode) in enumerate(plan.recvs):
            header.pack_into(r_head[j].data)
            r_off[j], r_len[j], r_mode[j] = start, stop - start, mode
            r_total += stop - start
        state = np.zeros(stream_kernel.STATE_SIZE, np.int64)
        hbuf = np.frombuffer(in_p.hbuf, np.uint8)
        if in_p.rx_phase is RxPhase.HELD:
            # The first frame's header was read ahead (while this rank waited elsewhere).
            if not nr or bytes(in_p.hbuf) != r_head[0].tobytes():
                return None  # the frame path reports it
            state[3] = HEADER_SIZE
            state[stream_kernel.R_CRC] = crc32c(in_p.hbuf)
            in_p.rx_phase = RxPhase.HEADER
        bounce = np.frombuffer(in_p.bounce, work.dtype)
        tbuf = np.zeros(stream_kernel.TRAILER_SIZE, np.uint8)
        op = _STREAM_OPS[plan.op]
        divisor = work.dtype.type(plan.divisor)
        started = time.monotonic()
        status = -1
        # Look without sleeping for a moment before each block, as the frame path does for
        # the frames its caller waits for (a reply to a small frame usually comes within
        # microseconds; waking from poll costs a reschedule), in streams that receive no
        # more than such frames (larger ones wait on the link, where a spin is wasted CPU).
        # Not where this host runs more ranks than it has cores: spinning then keeps the
        # awaited rank off the core (4 ranks on 2 cores: up to 1.17x slower with 10 us looks).
        # Between looks the core goes to any rank that shares it (sched_yield): on the
        # emulated testbed, whose hosts share cores unseen, a plain spin made small streams
        # 1.15-1.25x slower.
        spin = self._spin_seconds if r_total * work.itemsize <= HELPER_RECEIVE_BYTES else 0.0
        spin_end = -1.0  # from the first look on
        moved = state[:4].tolist()
        watch: np.ndarray[Any, np.dtype[np.int32]] | None = None
        try:
            while True:
                if self._failure is not None:
                    status = StreamStatus.WAKE
                    break
                now = time.monotonic()
                left = deadline - now
                if left <= 0:
                    status = -1
                    break
                if spin_end < 0:
                    spin_end = now + spin
                spinning = now < spin_end
                if watch is None or not spinning:  # the idle connections, fresh before a block
                    watch = np.array([p.fd for p in self._links
                                      if p is not in_p and p.state is PeerState.OPEN
                                      and p.rx_phase is RxPhase.HEADER and not p.rx.locked()],
                                     np.int32)
                    pfd = np.zeros(2 * (3 + watch.size), np.int32)
                status = stream_kernel.run_stream_checked(
                    work, src, op, divisor, out_p.fd, in_p.fd, self._wake_r, watch,
                    s_head, s_off, s_len, s_src, s_after, r_head, r_off, r_len, r_mode,
                    bounce, hbuf, pfd, state,
                    0 if spinning else max(1, int(min(left, IDLE_LOOK_SECONDS) * 1000)),
                    self.checksum, tbuf)
                if status == StreamStatus.WATCH:
                    self.progress()  # an abort notice or a lost peer fails the transport
                    watch = None
                elif status != StreamStatus.IDLE:
                    break
                elif spinning:
                    if (now_moved := state[:4].tolist()) != moved:
                        moved = now_moved
                        spin_end = time.monotonic() + spin
                    os.sched_yield()  # a rank that shares this core runs first
        finally:  # the frames done: one message and header + payload (+ checksum) bytes each
            sent, received = int(state[0]), int(state[2])
            frame = HEADER_SIZE + self._trailer
            if sent < ns:
                s_total = int(s_len[:sent].sum())
            if received < nr:
                r_total = int(r_len[:received].sum())
            self.stats.add_sent(sent * frame + s_total * work.itemsize, sent)
            self.stats.add_received(received * frame + r_total * work.itemsize, received)
        return _StreamEnd(int(status), int(state[0]), int(state[1]), int(state[2]), started)

    def _stream_error(self, end: _StreamEnd, out_p: _Peer, in_p: _Peer,
                      plan: StreamPlan) -> BitcollError:
        """The error a stream ended with (``end``; ``in_p``'s reader token held): the
        transport has failed through its one failure path (unless it is closing)."""
        status = end.status
        if status == -1:
            # Past the deadline: about the oldest unfinished receive (or send, once every
            # receive is done).
            if end.received < len(plan.recvs):
                req = _TCPRequest(self, in_p.rank, plan.recvs[end.received][0],
                                  memoryview(b""), False)
            else:
                req = _TCPRequest(self, out_p.rank, plan.sends[end.sent][0],
                                  memoryview(b""), True)
            req.posted = end.started
            error = self._timeout_for(req)
            self._fail(error)
            return self._failure or error
        if status == StreamStatus.MISMATCH:
            try:
                header = FrameHeader.unpack(in_p.hbuf)
            except ProtocolError as exc:  # bad magic or version
                self._fail(ProtocolError(f"from rank {in_p.rank}: {exc}", rank=self.rank,
                                         peer=in_p.rank))
            else:
                if header.kind == FrameKind.ABORT:
                    self._abort_notice(in_p, header, None, 0)
                else:
                    self._mismatch(in_p, header, plan.recvs[end.received][0])
        elif status == StreamStatus.CHECKSUM:
            self._fail(self._checksum_error(in_p.rank, plan.recvs[end.received][0]))
        elif status == StreamStatus.EOF:
            self._eof(in_p, between_frames=False)
        elif status in (StreamStatus.RECV_ERROR, StreamStatus.SEND_ERROR):
            p = in_p if status == StreamStatus.RECV_ERROR else out_p
            err = p.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) or errno.EPIPE
            return self._os_error(p, OSError(err, os.strerror(err)))
        return self._failure or UsageError("the TCP transport is closed")

    def _helper_loop(self, p: _Peer) -> None:
        """The receiver thread: serve the receives handed to it (large ones, plain or
        consumed, and everything posted while the caller blocks elsewhere); after a failure
        read and drop what the peer still sends until it closes."""

        def busy() -> bool:
            return p.state is PeerState.OPEN and self._failure is None and not self._closing

        def serve() -> None:
            if self._failure is not None:
                self._drop_until_closed(p)
            while p.posted and busy():
                self._advance(p, blocking=True)

        p.serve_handed(serve, busy)

    def _drop_until_closed(self, p: _Peer) -> None:
        """Failed: read and drop whatever ``p`` still sends until it closes, so that a peer
        blocked writing to this rank is released at once (reader token held)."""
        if self._closing or p.state is PeerState.PEER_CLOSED:
            return
        scratch = bytearray(1 << 16)
        with contextlib.suppress(OSError):
            while not self._closing and p.sock.recv_into(scratch):
                pass

    def _advance(self, p: _Peer, blocking: bool) -> Want:
        """Run ``p``'s receive machine (:class:`RxPhase`) as far as the socket allows:
        complete posted receives in order, notice ABORT frames, end of file and errors.
        ``blocking``: wait for bytes (the receiver thread; stops when nothing is posted);
        otherwise read only what is there. Precondition: the reader token ``p.rx`` is held."""
        sock = p.sock
        flags = WAITALL if blocking else DONTWAIT
        try:
            while self._failure is None and p.state is PeerState.OPEN:
                phase = p.rx_phase
                req = p.head()
                if phase is RxPhase.HEADER:
                    if req is None and blocking:
                        return Want.IDLE
                    if req is not None and req.helper and not blocking:
                        return Want.HELPER
                    got = p.rx_got
                    if got == 0 and req is not None and req.consume is None and len(req.view):
                        # The header and whatever part of the payload (and its trailer) is
                        # here, in one call.
                        n = sock.recvmsg_into((p.hview, req.view, p.tview)
                                              if self._trailer else (p.hview, req.view), 0,
                                              0 if blocking else DONTWAIT)[0]
                    else:
                        n = sock.recv_into(p.hview[got:], HEADER_SIZE - got, flags)
                    if n == 0:
                        self._eof(p, between_frames=got == 0)
                        return Want.IDLE
                    got += n
                    if got < HEADER_SIZE:
                        p.rx_got = got
                        continue
                    p.rx_got = 0
                    header = FrameHeader.unpack(p.hbuf)
                    early = got - HEADER_SIZE
                    if header.kind == FrameKind.ABORT:
                        self._abort_notice(p, header, req, early)
                        return Want.IDLE
                    p.rx_header = header
                    if req is None:
                        p.rx_phase = RxPhase.HELD
                        return Want.IDLE
                    self._match(p, req, header, early)
                elif phase is RxPhase.HELD:
                    if req is None:
                        return Want.IDLE
                    if req.helper and not blocking:
                        return Want.HELPER
                    assert p.rx_header is not None
                    self._match(p, req, p.rx_header, 0)
                elif phase is RxPhase.BODY:
                    assert req is not None and p.rx_header is not None
                    n = p.rx_header.length
                    tail = 0  # trailer bytes read with the payload's end
                    if req.consume is not None and n <= len(p.bounce):
                        # One piece: read it whole into the bounce buffer (with the trailer
                        # when it is there too), then consume it.
                        got = p.rx_got
                        if got < n:
                            k, tail = self._read_body(sock, p.bounce[got:n], p, flags)
                            if k == 0:
                                self._eof(p, between_frames=False)
                                return Want.IDLE
                            p.rx_got = got = min(got + k, n)
                            if got == n:
                                self._deliver(p, req, 0, p.bounce[:n])
                    elif req.consume is not None:
                        if not blocking:
                            return Want.HELPER
                        if not self._consume(p, req, p.rx_header):
                            return Want.IDLE
                    else:
                        got = p.rx_got
                        n, tail = self._read_body(sock, req.view[got:], p, flags)
                        if n == 0:
                            self._eof(p, between_frames=False)
                            return Want.IDLE
                        if p.rx_sum >= 0:
                            p.rx_sum = crc32c_raw(req.view[got:got + n - tail], p.rx_sum)
                        p.rx_got = min(got + n, len(req.view))
                    if p.rx_got == p.rx_header.length:
                        self._payload_done(p, req, tail)
                else:  # TAG
                    assert req is not None
                    got = p.rx_got
                    n = sock.recv_into(p.tview[got:], self._trailer - got, flags)
                    if n == 0:
                        self._eof(p, between_frames=False)
                        return Want.IDLE
                    p.rx_got = got + n
                    if p.rx_got == self._trailer:
                        self._check_tag(p, req)
            return Want.IDLE
        except (BlockingIOError, InterruptedError):
            return Want.READ
        except ConsumerFailed:
            return Want.IDLE
        except ProtocolError as exc:  # bad magic or version
            self._fail(ProtocolError(f"from rank {p.rank}: {exc}", rank=self.rank, peer=p.rank))
            return Want.IDLE
        except OSError as exc:
            self._os_error(p, exc)
            return Want.IDLE

    def _match(self, p: _Peer, req: _TCPRequest, header: FrameHeader, early: int) -> None:
        """A data header for ``req`` (``early`` payload bytes already in ``req.view``):
        check it, then go on to the payload (HEADER/HELD -> BODY)."""
        if self._mismatch(p, header, req.header):
            return
        p.rx_phase = RxPhase.BODY
        p.rx_got = early
        if p.key_in is not None:
            if req.consume is not None:
                p.rx_mac = tag_hasher(p.key_in, p.count_in, bytes(p.hbuf))
        elif self.checksum:
            # The checksum follows the bytes as they arrive (each piece while the next is on
            # the wire), so only the last piece's part waits at the frame's end.
            p.rx_sum = crc32c_raw(p.hbuf)
            if early and req.consume is None:
                p.rx_sum = crc32c_raw(req.view if early >= header.length else
                                      req.view[:early], p.rx_sum)
        if early >= header.length and req.consume is None:
            self._payload_done(p, req, early - header.length)

    def _mismatch(self, p: _Peer, header: FrameHeader, expected: FrameHeader) -> bool:
        """Whether the data header ``header`` from ``p`` differs from ``expected``; if it
        does, the transport has failed (ProtocolError, or the peer's abort reason)."""
        msg = header.mismatch(expected, p.rank)
        if msg is None:
            return False
        # A peer that aborted in the middle of a frame left that frame's header here: its
        # reason explains the mismatch better than the headers do.
        aborted = self._abort_reason(p.rank)
        self._fail(ProtocolError(msg, rank=self.rank, peer=p.rank, sequence=expected.seq,
                                 slots=header.differing(expected), collective=self.collective)
                   if aborted is None else
                   PeerLostError(aborted, rank=self.rank, peer=p.rank))
        return True

    def _payload_done(self, p: _Peer, req: _TCPRequest, tail: int = 0) -> None:
        """The payload is in, and ``tail`` bytes of its trailer (read with it into ``p.tag``):
        BODY -> TAG (integrity or checksum on; checked at once when the whole trailer is
        in) or complete the frame."""
        if self._trailer:
            p.rx_phase = RxPhase.TAG
            p.rx_got = tail
            if tail == self._trailer:
                self._check_tag(p, req)
            return
        self._complete(p, req, 0)

    def _read_body(self, sock: socket.socket, view: memoryview, p: _Peer,
                   flags: int) -> tuple[int, int]:
        """Read into ``view`` (the rest of a payload) what is there, and with the checksum or
        tag on, the beginning of the trailer after it in the same call (into ``p.tag``).
        Returns the bytes read (0: end of file) and how many of them are trailer bytes."""
        if not self._trailer:
            return sock.recv_into(view, len(view), flags), 0
        n: int = sock.recvmsg_into((view, p.tview), 0, flags)[0]
        return n, max(0, n - len(view))

    def _complete(self, p: _Peer, req: _TCPRequest, extra: int) -> None:
        """The frame of ``req`` (the oldest posted receive) is complete: -> HEADER."""
        if not p.pop(req):
            return  # failed meanwhile: the failure path finished it
        p.rx_phase = RxPhase.HEADER
        p.rx_got = 0
        self.stats.add_received(HEADER_SIZE + req.header.length + extra)
        req._finish(None)

    def _consume(self, p: _Peer, req: _TCPRequest, header: FrameHeader) -> bool:
        """Read the payload and feed it to ``req.consume`` in :data:`CONSUME_CHUNK_BYTES`
        pieces (blocking; the receiver thread); False at end of file. An exception from the
        consumer fails the transport (and so the request): ConsumerFailed."""
        assert req.consume is not None
        chunk = p.bounce
        n = header.length
        pos = p.rx_got
        while pos < n:
            k = min(len(chunk), n - pos)
            if recv_exact(p.sock, chunk[:k]) < k:
                self._eof(p, between_frames=False)
                return False
            self._deliver(p, req, pos, chunk[:k])
            pos += k
            p.rx_got = pos
        return True

    def _deliver(self, p: _Peer, req: _TCPRequest, pos: int, chunk: memoryview) -> None:
        """Hand ``chunk`` (payload bytes from ``pos``) to the frame's tag hasher or checksum
        and to ``req.consume`` (:meth:`LinkTransport._consume_piece`: ConsumerFailed when it
        raises)."""
        assert req.consume is not None
        if p.rx_mac is not None:
            p.rx_mac.update(chunk)
        elif p.rx_sum >= 0:
            p.rx_sum = crc32c_raw(chunk, p.rx_sum)
        self._consume_piece(p.rank, req.consume, pos, chunk)

    def _check_tag(self, p: _Peer, req: _TCPRequest) -> None:
        """The trailer of ``req``'s frame is in ``p.tag``: verify it (TAG -> HEADER), or fail
        the transport."""
        if p.key_in is None:
            self._check_sum(p, req)
            return
        if req.consume is not None:
            want = p.rx_mac.digest(FRAME_TAG_BYTES)
            p.rx_mac = None
        else:
            want = frame_tag(p.key_in, p.count_in, bytes(p.hbuf), req.view)
        p.count_in += 1
        if not hmac.compare_digest(want, bytes(p.tag)):
            self._fail(ProtocolError(f"rank {self.rank}: a frame from rank {p.rank} failed its "
                                     "integrity check (altered on the way, or not sent by it)",
                                     rank=self.rank, peer=p.rank))
            return
        self._complete(p, req, FRAME_TAG_BYTES)

    def _check_sum(self, p: _Peer, req: _TCPRequest) -> None:
        """The checksum of ``req``'s frame is in ``p.tag``: verify it (TAG -> HEADER), or fail
        the transport with ProtocolError naming the link."""
        # Fed as the header and payload arrived (_match, _advance, _deliver).
        ok = p.rx_sum == int.from_bytes(p.tview, "little")
        p.rx_sum = -1
        if not ok:
            self._fail(self._checksum_error(p.rank, req.header))
            return
        self._complete(p, req, CHECKSUM_BYTES)

    def _checksum_error(self, peer: int, header: FrameHeader) -> ProtocolError:
        return ProtocolError(
            f"rank {self.rank}: a frame from rank {peer} failed its checksum (collective "
            f"#{header.seq}, step {header.step}, {header.length} bytes): it was altered on the "
            f"link from rank {peer} to rank {self.rank} (a faulty NIC, switch, cable or "
            "memory); no result was delivered", rank=self.rank, peer=peer,
            sequence=header.seq)

    def _abort_notice(self, p: _Peer, header: FrameHeader, req: _TCPRequest | None,
                      early: int) -> None:
        """``p`` sent an ABORT frame; ``early`` bytes of its reason landed in ``req.view``
        (and past its end, in ``p.tag``).
        With frame integrity on, its tag must verify: a notice that does not is a
        ProtocolError (not sent by ``p``: its text is not shown), one cut short is a lost
        connection."""
        tagged = p.key_in is not None
        if tagged and header.length > MAX_REASON_BYTES:
            self._fail(ProtocolError(f"rank {self.rank}: a control frame from rank {p.rank} "
                                     f"failed its integrity check (an abort notice of "
                                     f"{header.length} bytes; altered on the way, or not sent "
                                     "by it)", rank=self.rank, peer=p.rank))
            return
        n = min(header.length, MAX_REASON_BYTES) + (FRAME_TAG_BYTES if tagged else 0)
        raw = bytearray(n)
        have = 0
        if req is not None and early > 0:
            have = min(early, n)
            landed = bytes(req.view[:have]) + bytes(p.tag[:max(0, have - len(req.view))])
            raw[:have] = landed[:have]
        # The notice was written with one call: the rest is (nearly always) here already.
        end = time.monotonic() + ABORT_STORE_SECONDS
        view = memoryview(raw)
        with contextlib.suppress(OSError):
            while have < n:
                left = end - time.monotonic()
                if left <= 0 or not select.select([p.sock], [], [], left)[0]:
                    break
                k = p.sock.recv_into(view[have:], n - have, DONTWAIT)
                if k == 0:
                    break
                have += k
        if tagged:
            assert p.key_in is not None
            if have < n:
                self._fail(PeerLostError(self._lost_message(p.rank, None), rank=self.rank,
                                         peer=p.rank))
                return
            text = bytes(raw[:header.length])
            if not hmac.compare_digest(
                    frame_tag(p.key_in, p.count_in, bytes(p.hbuf), text),
                    bytes(raw[header.length:])):
                self._fail(ProtocolError(f"rank {self.rank}: a control frame from rank "
                                         f"{p.rank} failed its integrity check (an abort "
                                         "notice altered on the way, or not sent by it)",
                                         rank=self.rank, peer=p.rank))
                return
            have = header.length
        self._fail(PeerLostError(f"rank {p.rank} aborted: {decode_reason(raw[:have])}",
                                 rank=self.rank, peer=p.rank))

    def _eof(self, p: _Peer, between_frames: bool) -> None:
        """The connection to ``p`` reached end of file: OPEN -> PEER_CLOSED when it came
        between frames with nothing posted, else the failure path."""
        if self._closing or self._failure is not None:
            return
        if between_frames and p.rx_phase is RxPhase.HEADER:
            with p.lock:
                if not p.posted and p.transition(PeerState.PEER_CLOSED):
                    return  # a clean close: only later calls involving p fail
        self._fail(PeerLostError(self._lost_message(p.rank, None), rank=self.rank,
                                 peer=p.rank))

    def _os_error(self, p: _Peer, exc: OSError) -> BitcollError:
        """The one mapping of a socket error on ``p``'s connection: the transport fails with
        PeerLostError (unless it is being closed); return the error to finish requests
        with."""
        if self._failure is None and not self._closing:
            self._fail(PeerLostError(self._lost_message(p.rank, exc), rank=self.rank,
                                     peer=p.rank))
        return self._failure or UsageError("the TCP transport is closed")

    # ---------------------------------------------------------------- stalls and reasons

    def silent_origin(self, peer: int, waited: float | None = None) -> int:
        """This rank timed out waiting for ``peer`` (for ``waited`` seconds): record that in
        the store and follow the chain of ranks that timed out waiting for others (each
        leaves ``stall/<rank>``) to the first one that is not waiting for anybody: the rank
        the silence started from (``peer`` itself when it left no record within the grace,
        :data:`STALL_GRACE_FRACTION` of ``waited`` bounded by :data:`STALL_GRACE_MIN_SECONDS`
        and :data:`STALL_GRACE_SECONDS` (the latter when ``waited`` is None), or when the
        chain runs in a circle). Never raises."""
        store = self._store
        if store is None:
            return peer
        with contextlib.suppress(CommError):
            store.set(self._key(KEY_STALL.format(self.rank)),
                      self._signed(KEY_STALL, str(peer).encode()),
                      time.monotonic() + ABORT_STORE_SECONDS)
        chain = [self.rank]
        current = peer
        grace = STALL_GRACE_SECONDS if waited is None else min(
            STALL_GRACE_SECONDS, max(STALL_GRACE_MIN_SECONDS, STALL_GRACE_FRACTION * waited))
        end = time.monotonic() + grace
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
                else:
                    raw = self._unsigned(KEY_STALL, current, raw)
                    if raw is None:
                        return current
            if raw is None or not raw.isdigit() or int(raw) >= self.size:
                return current
            current = int(raw)
        return peer

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
        raw = self._unsigned(KEY_ABORT, peer, raw)
        if raw is None:
            return None
        return f"rank {peer} aborted: {raw.decode('utf-8', errors='replace')}"

    def _store_mac(self, what: str, rank: int, value: bytes) -> bytes:
        assert self._rdv is not None
        return auth.mac(self._rdv.secret, f"store-{what}", self.job_id, self.size, rank, value)

    def _signed(self, what: str, value: bytes) -> bytes:
        """``value`` as this rank writes it under the store key ``what`` (``abort/`` or
        ``stall/``): followed by a proof of the job's secret, bound to the job, the key and
        this rank, when frame integrity is on (the store's messages carry no tag of their
        own)."""
        if not self.integrity:
            return value
        return value + self._store_mac(what, self.rank, value)

    def _unsigned(self, what: str, rank: int, raw: bytes) -> bytes | None:
        """The value ``rank`` wrote under ``what`` (see :meth:`_signed`); None (and a debug
        log) when its proof does not verify."""
        if not self.integrity:
            return raw
        value, proof = raw[:-auth.MAC_BYTES], raw[-auth.MAC_BYTES:]
        if len(raw) >= auth.MAC_BYTES and hmac.compare_digest(
                proof, self._store_mac(what, rank, value)):
            return value
        _log.debug("rank %d: ignored a store value under %r for rank %d: its proof of the "
                   "job's secret does not verify", self.rank, what, rank)
        return None

    def _lost_message(self, peer: int, exc: BaseException | None) -> str:
        """Why the connection to ``peer`` ended: its abort reason from the store if any."""
        reason = self._abort_reason(peer)
        if reason is not None:
            return reason
        how = f" ({exc})" if exc is not None else ""
        return (f"lost the connection to rank {peer}{how}: rank {peer} exited, was killed or "
                "closed its transport")

    # ---------------------------------------------------------------- failure / close

    def _spread_failure(self, error: CommError, reason: str) -> None:
        """The TCP part of the one failure path (``LinkTransport._fail``): tell every peer,
        move every connection to FAILED, fail every waiting request and wake every waiting
        thread. Never raises."""
        text = reason
        # 1. An ABORT frame on every connection that is between frames (the fast path). A
        # stream holding a connection's sending side gets the frame to send (between frames)
        # and does that connection's step 3 itself when it ends, at the wake-up below.
        deferred: set[_Peer] = set()
        for p in self._links:
            if p.send_lock.acquire(blocking=False):
                try:
                    if not p.partial:
                        with contextlib.suppress(OSError):
                            p.sock.send(abort_frame(text, p.key_out, p.count_sent),
                                        DONTWAIT | NOSIGNAL)
                finally:
                    p.send_lock.release()
            else:
                with p.lock:
                    if p.streaming:  # (never with frame integrity on)
                        p.notice = abort_frame(text)
                        deferred.add(p)
        # 2. The reason in the store, for peers that will only see the stream end mid-frame.
        if self._store is not None:
            with contextlib.suppress(CommError):
                self._store.set(self._key(KEY_ABORT.format(self.rank)),
                                self._signed(KEY_ABORT, text.encode("utf-8", "replace")
                                             [:MAX_REASON_BYTES]),
                                time.monotonic() + ABORT_STORE_SECONDS)
        # 3. SHUT_WR: peers read the end of the stream after what was sent (this rank's own
        # blocked sends fail at once); the receiver threads go on reading and dropping data
        # until the peers close, so no peer stays blocked writing to this rank.
        for p in self._links:
            if p not in deferred:
                with contextlib.suppress(OSError):
                    p.sock.shutdown(socket.SHUT_WR)
        for p in self._links:
            p.stop(PeerState.FAILED, error, drain=True)
        self._wake()

    def close(self, timeout: float | None = None) -> None:
        """Flush queued sends, close the connections, join the threads. Idempotent.

        ``timeout`` (default: ``close_timeout`` of :meth:`create`) bounds the wait for queued
        sends and, on rank 0, for the other ranks to leave the store (after a failure at most
        :data:`FAILED_CLOSE_SECONDS`). Requests still pending afterwards fail with UsageError.
        Never raises.
        """
        deadline = self._begin_close(timeout, self.close_timeout)
        if deadline is None:
            return
        def shut(p: _Peer) -> None:
            with contextlib.suppress(OSError):
                p.sock.shutdown(socket.SHUT_RDWR)

        self._close_links(self._links, deadline, shut, lambda p: p.sock.close())
        if self._rdv is not None:
            if self._failure is not None:
                deadline = min(deadline, time.monotonic() + FAILED_CLOSE_SECONDS)
            self._rdv.close(deadline)

