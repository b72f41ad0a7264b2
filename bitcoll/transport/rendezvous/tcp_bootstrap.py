"""Set-up of the TCP transport: rendezvous through a store, listening, the connection mesh.

Everything that happens before the first frame: :class:`_Rendezvous` (the store, its key
namespace and the job's secret), :func:`build_mesh` (job id, join, publish the listener, wait
for every rank's address, connect every pair with the authenticated hello of
:mod:`bitcoll.transport.handshake` through :class:`_Mesh`). The steady-state data path is
:mod:`bitcoll.transport.tcp`; the steps are described in its module docstring.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import selectors
import socket
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final, Protocol

from ...config import ENV_CHECKSUM, ENV_SEND_BUFFER, switch
from ...errors import (
    BitcollError,
    CommError,
    CommTimeoutError,
    PeerLostError,
    ProtocolError,
    UsageError,
)
from ..netio import NOSIGNAL, Backoff
from . import auth, handshake
from .external_store import ExternalStore
from .store import StoreClient, StoreServer

__all__ = ["SEND_BUFFER_BYTES", "RECEIVE_BUFFER_BYTES", "send_buffer_bytes", "RendezvousStore",
           "build_mesh", "tune", "KEY_SIZE",
           "KEY_JOB", "KEY_JOIN", "KEY_ADDR", "KEY_ABORT", "KEY_SECRET_FILE", "KEY_STALL",
           "KEY_INTEGRITY"]

#: Requested SO_SNDBUF of every data connection, in bytes (Linux doubles it: 256 KiB). It bounds
#: what a connection holds unsent or unacknowledged, and so what queues in front of a link:
#: enough for the bandwidth-delay product of 10 Gbit/s at 200 us round trips (25 Gbit/s at
#: 80 us). Larger send buffers only lengthen the queues: the bytes fall out of the CPU caches
#: before the receiver copies them (2 ranks on one host: a 256 MiB all-reduce took 1.9x as long
#: with 1 MiB asked for), and on shaped links every packet waits in the shaper. The
#: environment variable ``BITCOLL_SEND_BUFFER`` overrides it for paths with a larger product
#: (bytes; 0: the kernel's own sizing).
SEND_BUFFER_BYTES: Final = 128 << 10
#: Requested SO_RCVBUF of every data connection (doubled by Linux): room for what arrives
#: while the receiving rank is busy elsewhere. Raised to this, never lowered.
RECEIVE_BUFFER_BYTES: Final = 1 << 20

# Store keys, under the transport's namespace (``bitcoll/`` in its own store).
KEY_SIZE: Final = "size"
KEY_JOB: Final = "job"
KEY_JOIN: Final = "join/{}"
KEY_ADDR: Final = "addr/{}"
KEY_ABORT: Final = "abort/{}"
REFUSED: Final = b"refused "
"""What a rank that refuses at set-up (its world size or integrity setting differs from rank
0's) publishes as its address, followed by its reason: the others fail at once."""
KEY_SECRET_FILE: Final = "secretfile"
KEY_STALL: Final = "stall/{}"
KEY_INTEGRITY: Final = "integrity"

_log = logging.getLogger("bitcoll.tcp")


def send_buffer_bytes(value: int | None = None) -> int:
    """The SO_SNDBUF a data connection requests: ``value`` when given, else
    ``BITCOLL_SEND_BUFFER`` from the environment, else :data:`SEND_BUFFER_BYTES` (bytes; 0
    leaves the size to the kernel). UsageError when it is not a whole number from 0 to
    2**31 - 1."""
    name, given = "send_buffer", repr(value)
    if value is None:
        text = os.environ.get(ENV_SEND_BUFFER, "").strip()
        if not text:
            return SEND_BUFFER_BYTES
        name, given = ENV_SEND_BUFFER, repr(text)
        with contextlib.suppress(ValueError):
            value = int(text)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 31:
        raise UsageError(f"{name} must be a number of bytes from 0 to 2**31 - 1 (0: the "
                         f"kernel's sizing), got {given}", argument=name)
    return value


def tune(sock: socket.socket, send: int) -> None:
    """TCP_NODELAY and the buffers (set before connect/listen so the window scales): the send
    buffer set to ``send`` bytes (unless 0), the receive buffer raised to
    :data:`RECEIVE_BUFFER_BYTES`."""
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if send:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send)
    with contextlib.suppress(OSError):
        if sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) < RECEIVE_BUFFER_BYTES:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER_BYTES)


def _ranks(ranks: list[int] | set[int]) -> str:
    r = sorted(ranks)
    return ("rank " if len(r) == 1 else "ranks ") + ", ".join(str(x) for x in r)



def build_mesh(rank: int, size: int, rdv: _Rendezvous, deadline: float, timeout: float,
               listen_addr: str | None, integrity: bool, send_buffer: int,
               refusal: str | None = None, *,
               checksum: bool | None = None) -> tuple[dict[int, socket.socket], int]:
    """Steps 2-4 of the set-up: job id, join, publish the listener, connect the mesh;
    return ``({peer: connected socket}, job id)``. ``send_buffer``: the SO_SNDBUF of the
    connections (0: the kernel's). ``refusal``: why this rank cannot join (a bad setting of
    its own); it is published in place of an address, so the others fail at once, and raised
    here as a UsageError. ``checksum``: whether the data frames carry a checksum (None:
    ``BITCOLL_CHECKSUM``, else on; never with ``integrity``): every rank must agree, like
    on ``integrity``."""
    checksum = switch(checksum, "checksum", ENV_CHECKSUM, True) and not integrity
    store, key = rdv.store, rdv.key
    where = rdv.where
    listener: socket.socket | None = None
    try:
        if rank == 0:
            job_id = int.from_bytes(os.urandom(8), "little")
            store.set(key(KEY_SIZE), str(size).encode(), deadline)
            store.set(key(KEY_INTEGRITY), (b"1" if integrity else b"0")
                      + (b"c" if checksum else b""), deadline)
            store.set(key(KEY_JOB), str(job_id).encode(), deadline)
            size0 = size
        else:
            job_id = int(store.get(key(KEY_JOB), deadline))
            size0 = int(store.get(key(KEY_SIZE), deadline))
            frames0 = store.get(key(KEY_INTEGRITY), deadline)
            integrity0, checksum0 = frames0[:1] == b"1", frames0[1:] == b"c"
            if refusal is None and size0 != size:
                refusal = (f"rank {rank} was started with world size {size} but rank 0 with "
                           f"{size0}")
            elif refusal is None and integrity0 != integrity:
                refusal = (f"rank {rank} was started with integrity={integrity} but rank 0 "
                           f"with integrity={integrity0}")
            elif refusal is None and checksum0 != checksum:
                refusal = (f"rank {rank} was started with checksum={checksum} but rank 0 "
                           f"with checksum={checksum0} (pass the same checksum= to "
                           f"bitcoll.init, or set {ENV_CHECKSUM} alike, on every rank)")
        if refusal is not None:
            # Tell the others (they wait for this rank's address) instead of leaving them to
            # their deadline.
            if 0 <= rank < size0:
                with contextlib.suppress(BitcollError, OSError):
                    store.set(key(KEY_ADDR.format(rank)), REFUSED + refusal.encode()[:400],
                              deadline)
                    if rank == 0:
                        # They read it from this rank's store (and need its secret file to
                        # get in): keep both until every other rank has published an address
                        # (or a refusal of its own), i.e. is in and about to read this one.
                        store.wait([key(KEY_ADDR.format(p)) for p in range(1, size)],
                                   deadline)
            raise UsageError(refusal)
        if store.add(key(KEY_JOIN.format(rank)), 1, deadline) != 1:
            raise UsageError(f"two processes claim rank {rank} of the job at {where}")
        listener, host = _listen(store, listen_addr, size, send_buffer)
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
        published = {p: store.get(key(KEY_ADDR.format(p)), deadline)
                     for p in range(size) if p != rank}
        refused = {p: v for p, v in published.items() if v.startswith(REFUSED)}
        if refused:
            first = min(refused)
            reason = refused[first][len(REFUSED):].decode("utf-8", errors="replace")
            raise PeerLostError(f"rank {rank}: {_ranks(set(refused))} refused to join the job "
                                f"at {where}: {reason}", rank=rank, peer=first)
        addrs = {p: published[p].decode() for p in range(rank + 1, size)}
        socks = _Mesh(rank, size, job_id, rdv.secret, mine, deadline, timeout,
                      send_buffer).connect(listener, addrs)
    finally:
        if listener is not None:
            listener.close()
    return socks, job_id

def _listen(store: RendezvousStore, listen_addr: str | None, size: int,
            send_buffer: int) -> tuple[socket.socket, str]:
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
        tune(sock, send_buffer)
        sock.bind(sockaddr)
        sock.listen(max(_BACKLOG, 2 * size))
    except OSError as exc:
        sock.close()
        raise CommError(f"cannot listen on {bind_host!r}: {exc}") from exc
    return sock, publish


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


@dataclass(eq=False)
class _Rendezvous:
    """A transport's store, its key namespace (``prefix``) and the job's secret.

    ``owns``: the store (and on rank 0 the server) belongs to this transport and is closed with
    it; sub-groups borrow their parent's. ``secret_file``: rank 0's secret file while the other
    ranks may still need to read it.
    """

    store: RendezvousStore
    prefix: str
    secret: bytes
    where: str
    server: StoreServer | None = None
    owns: bool = False
    secret_file: auth.SecretFile | None = None

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


class _Pending:
    """A connection in the handshake: its stage, what it waits for and what it has read.

    Stages: on the connecting side ``"connecting"`` (TCP connect under way), ``"accept"``
    (waits for message 2), ``"done"`` (waits for message 4); on the accepting side
    ``"hello"`` (waits for message 1: nothing is known of the other end yet) and
    ``"confirm"`` (waits for message 3)."""

    __slots__ = ("buf", "need", "nonce_a", "nonce_b", "peer", "since", "source", "stage")

    def __init__(self, peer: int | None, stage: str, need: int, since: float,
                 source: str = "", nonce_a: bytes = b"") -> None:
        self.peer = peer  # the rank this side expects (connector) or claims to be (acceptor)
        self.stage = stage
        self.need = need
        self.since = since  # time.monotonic() when the connection was made or accepted
        self.source = source  # the other end's address ("host:port"), for the logs
        self.buf = bytearray()
        self.nonce_a = nonce_a
        self.nonce_b = b""

    @property
    def incoming(self) -> bool:
        return self.stage in ("hello", "confirm")


#: Most accepted connections that have not proven themselves yet (strangers among them) a rank
#: keeps at once; when one more arrives, the oldest is dropped: first among those that have
#: not even sent a valid hello, else the oldest of all.
MAX_PENDING_HANDSHAKES: Final = 256
#: How long an accepted connection may take to prove itself (messages 1 and 3 of the hello)
#: before it is dropped. A lower rank whose connection was dropped dials again.
HANDSHAKE_SECONDS: Final = 5.0
#: Most connections accepted in one round of the set-up loop (the others wait in the backlog
#: while the connections already accepted are read).
_ACCEPT_BATCH: Final = 64
#: The listener's backlog (at least; two per rank in large jobs).
_BACKLOG: Final = 128


class _Mesh:
    """Connects every pair of ranks with the authenticated hello of
    :mod:`bitcoll.transport.handshake`: this rank connects to every higher rank and accepts
    every lower one, all in one non-blocking loop.

    Accepting side: a connection that fails a check, takes longer than
    :data:`HANDSHAKE_SECONDS` to prove itself, or is the oldest unproven one when
    :data:`MAX_PENDING_HANDSHAKES` are waiting, or is still unproven when the set-up ends, is
    dropped and logged at debug level (logger ``bitcoll.tcp``, naming its address).
    Connecting side: an answer that fails the proof is a ProtocolError; a connection the
    higher rank closes before the hello is complete is dialed again (the higher rank may have
    dropped it as an unproven one), unless the higher rank no longer accepts connections at
    all (PeerLostError: it left the set-up)."""

    def __init__(self, rank: int, size: int, job_id: int, secret: bytes, mine: str,
                 deadline: float, timeout: float,
                 send_buffer: int = SEND_BUFFER_BYTES) -> None:
        self.rank = rank
        self.send_buffer = send_buffer
        self.size = size
        self.job_id = job_id
        self.secret = secret
        self.mine = mine  # the address this rank published ("<port> <host>")
        self.deadline = deadline
        self.timeout = timeout
        self.addrs: dict[int, str] = {}
        self.done: dict[int, socket.socket] = {}
        self.pending: dict[socket.socket, _Pending] = {}  # oldest first
        self.dial_at: dict[int, float] = {}  # higher ranks to dial, and from when
        self.backoff: dict[int, Backoff] = {}
        self.reached: set[int] = set()  # higher ranks whose listener answered once
        self.redials: dict[int, int] = {}  # connections a higher rank closed mid-hello
        self.dropped = 0  # incoming connections dropped (strangers, mostly)
        self.sel: selectors.BaseSelector = selectors.DefaultSelector()

    def _proof(self, role: str, a: int, b: int, nonce_a: bytes, nonce_b: bytes,
               addr_b: str) -> bytes:
        return handshake.proof(self.secret, role, self.job_id, self.size, a, b, nonce_a,
                               nonce_b, addr_b)

    def connect(self, listener: socket.socket, addrs: dict[int, str]) -> dict[int, socket.socket]:
        """Run the handshakes until every peer is connected; return ``{peer: socket}``."""
        self.addrs = addrs
        sel = self.sel
        now = time.monotonic()
        for peer in range(self.rank + 1, self.size):
            self.dial_at[peer] = now
            self.backoff[peer] = Backoff()
        ok = False
        try:
            listener.setblocking(False)
            sel.register(listener, selectors.EVENT_READ)
            while len(self.done) < self.size - 1:
                now = time.monotonic()
                if now >= self.deadline:
                    raise self._timed_out()
                for peer, when in list(self.dial_at.items()):
                    if when <= now:
                        del self.dial_at[peer]
                        self._dial(peer, now)
                self._expire(now)
                wake = min([self.deadline, now + 1.0, *self.dial_at.values(),
                            *(p.since + HANDSHAKE_SECONDS for p in self._incoming())])
                for key, _ in sel.select(max(0.0, wake - now)):
                    obj = key.fileobj
                    assert isinstance(obj, socket.socket)
                    if obj is listener:
                        self._accept(listener)
                    elif obj in self.pending:
                        if self.pending[obj].stage == "connecting":
                            self._connected(obj)
                        else:
                            self._read(obj)
            ok = True
        finally:
            for s, p in list(self.pending.items()):
                if p.incoming:  # strangers still unproven: logged with their addresses
                    self._drop(s, "the set-up ended before it proved itself")
                else:
                    self._forget(s)
            sel.close()
            if not ok:
                for s in self.done.values():
                    s.close()
        for s in self.done.values():
            s.setblocking(True)
            with contextlib.suppress(OSError):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return self.done

    def _incoming(self) -> list[_Pending]:
        return [p for p in self.pending.values() if p.incoming]

    def _timed_out(self) -> CommTimeoutError:
        absent = set(range(self.rank)) - self.done.keys()
        silent = set(range(self.rank + 1, self.size)) - self.done.keys()
        parts = []
        if absent:
            parts.append(f"{_ranks(absent)} never connected")
        if silent:
            parts.append(f"{_ranks(silent)} never answered the handshake")
        extra = ""
        if self.dropped:
            extra = (f" ({self.dropped} connection{'s' if self.dropped != 1 else ''} that did "
                     "not prove themselves were dropped here)")
        return CommTimeoutError(f"rank {self.rank}: {' and '.join(parts)} within "
                                f"{self.timeout:g} s{extra}")

    # -- the connecting side -------------------------------------------------------------

    def _dial(self, peer: int, now: float) -> None:
        """Start a non-blocking connection to ``peer``'s published address."""
        port_s, host_s = self.addrs[peer].split(" ", 1)
        try:
            infos = socket.getaddrinfo(host_s, int(port_s), type=socket.SOCK_STREAM)
        except (socket.gaierror, ValueError) as exc:
            raise PeerLostError(f"rank {self.rank}: rank {peer} published an unresolvable "
                                f"address {host_s!r}: {exc}", rank=self.rank,
                                peer=peer) from exc
        family, _, _, _, sockaddr = infos[0]
        s = socket.socket(family, socket.SOCK_STREAM)
        tune(s, self.send_buffer)
        s.setblocking(False)
        err = s.connect_ex(sockaddr)
        if err not in (0, errno.EINPROGRESS, errno.EAGAIN, errno.EWOULDBLOCK):
            s.close()
            self._dial_failed(peer, err)
            return
        self.pending[s] = _Pending(peer, "connecting", 0, now)
        self.sel.register(s, selectors.EVENT_WRITE)

    def _dial_failed(self, peer: int, err: int) -> None:
        """A connection to ``peer`` could not be made: dial again after a pause, unless
        ``peer`` refuses after it had accepted before (its listener is closed: it left the
        set-up)."""
        if err == errno.ECONNREFUSED and peer in self.reached:
            raise PeerLostError(f"rank {self.rank}: rank {peer} stopped accepting connections "
                                "during set-up (it failed or exited)", rank=self.rank,
                                peer=peer)
        _log.debug("rank %d: connecting to rank %d failed (%s); trying again", self.rank,
                   peer, os.strerror(err))
        self.dial_at[peer] = time.monotonic() + self.backoff[peer].next()

    def _connected(self, s: socket.socket) -> None:
        """The TCP connection to a higher rank is up (or failed): send message 1."""
        p = self.pending[s]
        assert p.peer is not None
        err = s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if not err:
            p.nonce_a = auth.new_nonce()
            hello = handshake.Hello(handshake.KIND_HELLO, self.rank, self.size, self.job_id,
                                    p.nonce_a).pack()
            if self._send(s, hello):
                self.reached.add(p.peer)
                p.stage, p.need = "accept", handshake.ACCEPT_SIZE
                self.sel.modify(s, selectors.EVENT_READ)
                return
            err = errno.ECONNRESET
        del self.pending[s]
        self.sel.unregister(s)
        s.close()
        self._dial_failed(p.peer, err)

    def _lost_outgoing(self, s: socket.socket, p: _Pending, why: str) -> None:
        """The higher rank ``p.peer`` closed (or broke) a connection this rank made before
        the hello completed: dial it again. It may have dropped the connection as one that
        took too long to prove itself; if it left the set-up, the next dial is refused."""
        assert p.peer is not None
        self._forget(s)
        self.redials[p.peer] = self.redials.get(p.peer, 0) + 1
        _log.debug("rank %d: rank %d %s during the handshake; dialing again", self.rank,
                   p.peer, why)
        self.dial_at[p.peer] = time.monotonic() + self.backoff[p.peer].next()

    def _on_accept(self, s: socket.socket, p: _Pending) -> None:
        """Connector, message 2 arrived: the acceptor's identity and proof; send message 3."""
        assert p.peer is not None
        h = handshake.Hello.unpack(p.buf)
        addr = self.addrs[p.peer]
        good = h.matches(handshake.KIND_ACCEPT, self.size, self.job_id) and \
            h.rank == p.peer and handshake.verify(
                self.secret, p.buf[handshake.HELLO_SIZE:], "accept", self.job_id, self.size,
                self.rank, p.peer, p.nonce_a, h.nonce, addr)
        if not good:
            port_s, host_s = addr.split(" ", 1)
            self._forget(s)
            raise ProtocolError(
                f"rank {self.rank}: the process at {host_s}:{port_s} is not rank {p.peer} of "
                f"this job (it answered as rank {h.rank} of {h.size}, version {h.version}, "
                f"job {h.job_id:#x}, or could not prove it knows the job's secret)",
                rank=self.rank, peer=p.peer)
        p.nonce_b = h.nonce
        confirm = self._proof("connect", self.rank, p.peer, p.nonce_a, h.nonce, addr)
        if not self._send(s, confirm):
            self._lost_outgoing(s, p, "closed the connection")
            return
        p.stage, p.need, p.buf = "done", handshake.DONE_SIZE, bytearray()

    def _on_done(self, s: socket.socket, p: _Pending) -> None:
        """Connector, message 4 arrived: the acceptor keeps the connection."""
        assert p.peer is not None
        addr = self.addrs[p.peer]
        if not handshake.verify(self.secret, p.buf, "done", self.job_id, self.size, self.rank,
                                p.peer, p.nonce_a, p.nonce_b, addr):
            port_s, host_s = addr.split(" ", 1)
            self._forget(s)
            raise ProtocolError(f"rank {self.rank}: the process at {host_s}:{port_s} did not "
                                f"complete the handshake of rank {p.peer} (a wrong final "
                                "proof)", rank=self.rank, peer=p.peer)
        self._forget(s, close=False)
        self.done[p.peer] = s

    # -- the accepting side --------------------------------------------------------------

    def _accept(self, listener: socket.socket) -> None:
        for _ in range(_ACCEPT_BATCH):
            try:
                conn, addr = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE and friends: make room, try again next round
                _log.debug("rank %d: accept failed during set-up: %s", self.rank, exc)
                if exc.errno in (errno.EMFILE, errno.ENFILE):
                    self._evict()
                return
            incoming = self._incoming()
            if len(incoming) >= MAX_PENDING_HANDSHAKES:
                self._evict(incoming)
            source = (f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) and len(addr) >= 2
                      else str(addr))
            conn.setblocking(False)
            self.pending[conn] = _Pending(None, "hello", handshake.HELLO_SIZE,
                                          time.monotonic(), source)
            self.sel.register(conn, selectors.EVENT_READ)
            self._read(conn)  # a rank sends its hello right after connecting

    def _evict(self, incoming: list[_Pending] | None = None) -> None:
        """Drop the oldest unproven incoming connection (one that has not sent a valid
        hello yet, if there is one)."""
        if incoming is None:
            incoming = self._incoming()
        if not incoming:
            return
        victim = next((p for p in incoming if p.stage == "hello"), incoming[0])
        s = next(k for k, v in self.pending.items() if v is victim)
        self._drop(s, f"evicted after {time.monotonic() - victim.since:.2f} s: "
                      f"{len(incoming)} connections were waiting to prove themselves")

    def _expire(self, now: float) -> None:
        """Drop the incoming connections that took longer than HANDSHAKE_SECONDS."""
        for s, p in list(self.pending.items()):
            if p.incoming and now - p.since >= HANDSHAKE_SECONDS:
                self._drop(s, f"did not prove itself within {HANDSHAKE_SECONDS:g} s")

    def _forget(self, s: socket.socket, close: bool = True) -> None:
        self.pending.pop(s, None)
        with contextlib.suppress(KeyError, ValueError):
            self.sel.unregister(s)
        if close:
            s.close()

    def _drop(self, s: socket.socket, why: str) -> None:
        """Drop an incoming connection (logged with its address)."""
        p = self.pending[s]
        self._forget(s)
        self.dropped += 1
        claim = "" if p.peer is None else f" (claiming rank {p.peer})"
        _log.debug("rank %d: dropped the connection from %s%s during set-up: %s", self.rank,
                   p.source, claim, why)

    def _read(self, s: socket.socket) -> None:
        p = self.pending[s]
        try:
            chunk = s.recv(p.need - len(p.buf))
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            if p.incoming:
                self._drop(s, f"broke the handshake: {exc}")
            else:
                self._lost_outgoing(s, p, f"broke the connection ({exc})")
            return
        if not chunk:
            if p.incoming:
                self._drop(s, "closed the connection during the handshake")
            else:
                self._lost_outgoing(s, p, "closed the connection")
            return
        p.buf += chunk
        if len(p.buf) < p.need:
            return
        if p.stage == "hello":
            self._on_hello(s, p)
        elif p.stage == "confirm":
            self._on_confirm(s, p)
        elif p.stage == "accept":
            self._on_accept(s, p)
        else:
            self._on_done(s, p)

    def _send(self, s: socket.socket, data: bytes) -> bool:
        """Write a handshake message (small: fits the empty socket buffer at once)."""
        try:
            return s.send(data, NOSIGNAL) == len(data)
        except OSError:
            return False

    def _on_hello(self, s: socket.socket, p: _Pending) -> None:
        """Acceptor, message 1 arrived: check it, answer with message 2."""
        h = handshake.Hello.unpack(p.buf)
        if not h.matches(handshake.KIND_HELLO, self.size, self.job_id) or \
                not 0 <= h.rank < self.rank or h.rank in self.done:
            self._drop(s, f"not a lower rank of this job (claims rank {h.rank} of "
                          f"{h.size}, job {h.job_id:#x}, version {h.version})")
            return
        p.peer, p.nonce_a, p.nonce_b = h.rank, h.nonce, auth.new_nonce()
        answer = handshake.Hello(handshake.KIND_ACCEPT, self.rank, self.size, self.job_id,
                                 p.nonce_b).pack()
        answer += self._proof("accept", h.rank, self.rank, p.nonce_a, p.nonce_b, self.mine)
        if not self._send(s, answer):
            self._drop(s, "could not be answered")
            return
        p.stage, p.need, p.buf = "confirm", handshake.CONFIRM_SIZE, bytearray()

    def _on_confirm(self, s: socket.socket, p: _Pending) -> None:
        """Acceptor, message 3 arrived: the connector's proof; answer with message 4."""
        assert p.peer is not None
        if p.peer in self.done or not handshake.verify(
                self.secret, p.buf, "connect", self.job_id, self.size, p.peer, self.rank,
                p.nonce_a, p.nonce_b, self.mine):
            self._drop(s, f"failed the proof of the job's secret for rank {p.peer}")
            return
        if not self._send(s, self._proof("done", p.peer, self.rank, p.nonce_a, p.nonce_b,
                                         self.mine)):
            self._drop(s, f"closed the connection of rank {p.peer} before its last message")
            return
        self._forget(s, close=False)
        self.done[p.peer] = s
