"""Set-up of the TCP transport: rendezvous through a store, listening, the connection mesh.

Everything that happens before the first frame: :class:`_Rendezvous` (the store, its key
namespace and the job's secret), :func:`build_mesh` (job id, join, publish the listener, wait
for every rank's address, connect every pair with the authenticated hello of
:mod:`bitcoll.transport.handshake` through :class:`_Mesh`). The steady-state data path is
:mod:`bitcoll.transport.tcp`; the steps are described in its module docstring.
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import socket
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final, Protocol

from ..config import ENV_SEND_BUFFER
from ..errors import (
    BitcollError,
    CommError,
    CommTimeoutError,
    PeerLostError,
    ProtocolError,
    UsageError,
)
from . import auth, handshake
from .external_store import ExternalStore
from .netio import NOSIGNAL, Backoff
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
                         f"kernel's sizing), got {given}")
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
               refusal: str | None = None) -> tuple[dict[int, socket.socket], int]:
    """Steps 2-4 of the set-up: job id, join, publish the listener, connect the mesh;
    return ``({peer: connected socket}, job id)``. ``send_buffer``: the SO_SNDBUF of the
    connections (0: the kernel's). ``refusal``: why this rank cannot join (a bad setting of
    its own); it is published in place of an address, so the others fail at once, and raised
    here as a UsageError."""
    store, key = rdv.store, rdv.key
    where = rdv.where
    listener: socket.socket | None = None
    try:
        if rank == 0:
            job_id = int.from_bytes(os.urandom(8), "little")
            store.set(key(KEY_SIZE), str(size).encode(), deadline)
            store.set(key(KEY_INTEGRITY), b"1" if integrity else b"0", deadline)
            store.set(key(KEY_JOB), str(job_id).encode(), deadline)
            size0 = size
        else:
            job_id = int(store.get(key(KEY_JOB), deadline))
            size0 = int(store.get(key(KEY_SIZE), deadline))
            integrity0 = store.get(key(KEY_INTEGRITY), deadline) == b"1"
            if refusal is None and size0 != size:
                refusal = (f"rank {rank} was started with world size {size} but rank 0 with "
                           f"{size0}")
            elif refusal is None and integrity0 != integrity:
                refusal = (f"rank {rank} was started with integrity={integrity} but rank 0 "
                           f"with integrity={integrity0}")
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
        sock.listen(max(16, 2 * size))
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


def _connect(addr: tuple[str, int], deadline: float, peer: int,
             send_buffer: int) -> socket.socket:
    """Connect to a published address, retrying refused connections until ``deadline``."""
    backoff = Backoff()
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
        tune(sock, send_buffer)
        sock.settimeout(min(left, 10.0))
        try:
            sock.connect(sockaddr)
        except OSError:
            sock.close()
            backoff.sleep(deadline)
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
                s = _connect((host_s, int(port_s)), self.deadline, peer, self.send_buffer)
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
            return s.send(data, NOSIGNAL) == len(data)
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
