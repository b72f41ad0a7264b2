"""A small rendezvous key-value store over TCP, authenticated and bounded against strangers.

Rank 0 of a TCP job runs a :class:`StoreServer` (one background thread); every rank, rank 0
included, talks to it through a :class:`StoreClient`. The ranks use it to agree on a job id, to
publish the address each rank listens on, and to leave the reason of an abort where the peers can
read it. It is not on the data path.

Operations (every blocking one takes a ``deadline``, a ``time.monotonic()`` value):

* ``set(key, value)``: store ``value`` (bytes) under ``key`` (str), replacing any old value.
* ``get(key, deadline)``: the value of ``key``, blocking until some client sets it.
* ``try_get(key)``: the value of ``key`` or None, without waiting.
* ``add(key, delta)``: atomically add ``delta`` to the integer stored under ``key`` (a missing
  key counts as 0) and return the new value. Counters are stored as ASCII decimal, so
  ``get`` after ``add(key, 3)`` returns ``b"3"``.
* ``wait(keys, deadline)``: block until every key is present.
* ``missing(keys)``: the keys among ``keys`` that are not present, without waiting.

Errors: :class:`~bitcoll.errors.CommTimeoutError` when a deadline passes (for
:meth:`StoreClient.connect`: no store of this job answered, the message says why the last
attempt failed), :class:`~bitcoll.errors.PeerLostError` when an established connection to the
server breaks, :class:`~bitcoll.errors.UsageError` for bad arguments (a key longer than
:data:`MAX_KEY_BYTES` UTF-8 bytes, a value longer than :data:`MAX_VALUE`, ``add`` on a value that
is not a decimal integer), for a store that is full (:data:`MAX_KEYS`,
:data:`MAX_STORED_BYTES`), for a store of a *later* generation (this process is behind), and
for a secret file that cannot be used (:func:`bitcoll.transport.auth.read_secret_file`).

Authentication. Every connection starts with a mutual challenge-response (below): the server
proves that it knows the job's secret over a fresh client nonce, then the client proves the same
over a fresh server nonce, so neither a replayed nor a squatting stranger gets in or is believed.
The server proves itself first: a stranger squatting the store's port (there before rank 0, or
relaying it) gets nothing from a rank that it could test guesses of the secret against. (Any
process that reaches the real store gets the store's proof over a nonce of its choice: as
with any proof of a shared key, a secret that can be guessed offline is unsafe, which is why
the TCP set-up refuses short hand-set secrets for jobs on several hosts; see
:func:`bitcoll.transport.auth.check_secret`.)
Both proofs cover the store's *generation*, an integer both sides are given (a job that builds
several communicators on the same address counts them): a client that meets a store of an
earlier generation (still closing) hangs up and retries; one that meets a later generation
raises UsageError. A connection that fails the handshake is dropped and logged at debug level
(logger ``bitcoll.store``); the store is unharmed. Only the handshake is authenticated, not
every later message (the threat is other local users and strangers on the network, not an
attacker able to rewrite an established TCP stream).

Server design. One thread runs a selector loop over non-blocking sockets and owns all state
(no lock is held while a large value is copied, no thread per connection); GET and WAIT
requests that cannot be answered yet are parked (per-key waiter lists and a deadline heap) and
answered when a SET or ADD satisfies them or at their timeout. :meth:`StoreServer.close` wakes
the loop and joins it within a bound; it never waits on a client.

Limits (module constants; a connection that breaks a limit marked *drop* is closed, one that
breaks a limit marked *error* gets an ERROR reply and stays usable):

======================= ========= ==================================================================
constant                value     meaning
======================= ========= ==================================================================
``MAX_BODY``            1.125 MiB largest message body; a larger length prefix is refused before
                                  anything is allocated (*drop*)
``MAX_VALUE``           1 MiB     largest value (*error*; the client checks it before sending)
``MAX_KEY_BYTES``       65535     largest key, UTF-8 bytes (the wire's u16)
``MAX_KEYS``            65536     most keys the store holds (*error* for a SET/ADD of a new key)
``MAX_STORED_BYTES``    64 MiB    most key + value bytes the store holds (*error*)
``MAX_HINT_BYTES``      4096      longest secret-file hint a server may announce
``AUTH_SECONDS``        5 s       an unauthenticated connection must finish the handshake (*drop*)
``IO_SECONDS``          30 s      an authenticated one must finish a started message, and read a
                                  reply, within this (*drop*: slowloris, clients that never read)
``MAX_PENDING_AUTH``    64        most unauthenticated connections at once; more wait in the
                                  kernel's backlog until a handshake ends or the oldest has
                                  waited 1 s (``AUTH_SECONDS / 2`` if shorter): it is then evicted
                                  (slow strangers cannot lock the job out, a flood of them cannot
                                  evict a client in the middle of its handshake)
======================= ========= ==================================================================

Memory per connection: a read buffer of at most ``4 + MAX_BODY`` bytes, grown only as bytes
arrive (a client that fills it while its previous request is still pending is dropped), and the
one reply being written (a GET reply shares the stored value, it is not copied; the server
runs a connection's next request only once the previous reply is out). The accept loop survives
``EMFILE``/``ENFILE``/``ECONNABORTED`` and other transient errors (logged at debug level; it
backs off briefly, evicting the oldest unauthenticated connection when out of descriptors).

Wire protocol (little-endian, no pickle). The handshake first:

========= ==================================================================================
direction bytes
========= ==================================================================================
S -> C    greeting: ``b"BCS1"``, u16 protocol version (2), u16 hint length, u64 generation,
          16-byte server nonce, then the hint (UTF-8: the path of the job's secret file for
          clients that were given no secret, or empty)
C -> S    16-byte client nonce
S -> C    ``mac(secret, "store-server", server nonce, client nonce, generation)`` (32 bytes;
          :func:`bitcoll.transport.auth.mac`; the generation is the greeting's). A client that
          cannot verify it hangs up.
C -> S    ``mac(secret, "store-client", server nonce, client nonce, generation)`` (32 bytes)
S -> C    status byte 0; or status byte 1 (the client's proof is wrong) and the server closes
========= ==================================================================================

Then requests and replies. Every message is ``u32 body_length`` then the body. A request body
starts with a one-byte opcode; a reply body with a one-byte status (0 OK, 1 TIMEOUT, 2 ERROR
followed by a UTF-8 message). Keys are encoded as ``u16 length + UTF-8 bytes``; timeouts as
``u32`` milliseconds. A request must not carry trailing bytes. The server answers a
connection's requests one at a time, in order (a client may pipeline a few, the
:class:`StoreClient` does not).

====== ===================================== ==========================================
opcode request fields                         OK reply / TIMEOUT reply
====== ===================================== ==========================================
1 SET  key, value (rest of the body)           empty
2 GET  timeout, key                            value / empty
3 ADD  i64 delta, key                          i64 new value
4 WAIT timeout, u16 count, keys                empty / u16 count + the missing keys
5 MISS u16 count, keys                         u16 count + the missing keys
====== ===================================== ==========================================

A timeout of 0 answers at once. The server answers GET and WAIT at the requested timeout; the
client waits for that answer a little longer than its own deadline, so a hung server still
gives a :class:`~bitcoll.errors.CommTimeoutError`.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import heapq
import itertools
import logging
import math
import select
import selectors
import socket
import struct
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Final

from ...errors import CommError, CommTimeoutError, PeerLostError, UsageError
from ..netio import Backoff, recv_bytes
from . import auth

__all__ = [
    "StoreServer",
    "StoreClient",
    "MAX_BODY",
    "MAX_VALUE",
    "MAX_KEY_BYTES",
    "MAX_KEYS",
    "MAX_STORED_BYTES",
    "MAX_HINT_BYTES",
    "AUTH_SECONDS",
    "IO_SECONDS",
    "MAX_PENDING_AUTH",
]

log = logging.getLogger("bitcoll.store")

_U32 = struct.Struct("<I")
_U16 = struct.Struct("<H")
_I64 = struct.Struct("<q")
#: magic, protocol version, hint length, generation, server nonce
_GREETING = struct.Struct(f"<4sHHQ{auth.NONCE_BYTES}s")

MAGIC: Final = b"BCS1"
PROTOCOL_VERSION: Final = 2
_AUTH_OK: Final = 0
_AUTH_REJECTED: Final = 1

OP_SET = 1
OP_GET = 2
OP_ADD = 3
OP_WAIT = 4
OP_MISSING = 5

ST_OK = 0
ST_TIMEOUT = 1
ST_ERROR = 2

#: Largest value a SET may store.
MAX_VALUE: Final = 1 << 20
#: Largest key, in UTF-8 bytes (the wire encodes key lengths as u16).
MAX_KEY_BYTES: Final = 0xFFFF
#: Largest message body either side accepts: a largest value plus room for a largest key.
MAX_BODY: Final = MAX_VALUE + (1 << 17)
#: Most keys the store holds.
MAX_KEYS: Final = 65536
#: Most bytes (keys' UTF-8 plus values) the store holds.
MAX_STORED_BYTES: Final = 64 << 20
#: Longest hint (secret-file path) a server announces, in UTF-8 bytes.
MAX_HINT_BYTES: Final = 4096
#: Seconds an unauthenticated connection has to complete the handshake.
AUTH_SECONDS: Final = 5.0
#: Seconds an authenticated connection has to complete a started message or read a reply.
IO_SECONDS: Final = 30.0
#: Most unauthenticated connections the server holds at once.
MAX_PENDING_AUTH: Final = 64
#: Largest generation (u64).
_MAX_GENERATION: Final = (1 << 64) - 1

#: Largest timeout a request can carry, in milliseconds.
_MAX_TIMEOUT_MS = 0xFFFFFFFF
#: How much longer than its own deadline a client waits for the server's TIMEOUT answer.
_REPLY_GRACE = 2.0
#: Default deadline of operations called without one, in seconds.
DEFAULT_TIMEOUT = 60.0
#: The server's receive scratch buffer (one per server, reused for every recv).
_READ_CHUNK = 256 << 10
#: Connections accepted per wake-up of the loop (then other sockets get their turn).
_ACCEPT_BATCH = 64
#: Pause of the accept loop after an error such as EMFILE: first, most.
_ACCEPT_BACKOFF = (0.05, 1.0)
#: How long close() waits for the loop thread.
_CLOSE_JOIN_SECONDS = 5.0
#: Longest wait of the loop in one select() (epoll cannot wait for weeks).
_MAX_SELECT_SECONDS = 3600.0
#: Longest a client spends on one connection attempt's handshake before retrying.
_ATTEMPT_SECONDS = 10.0
#: Longest key shown in an error message.
_SHOWN_KEY = 100


class _Malformed(Exception):
    """A request that cannot be decoded (internal to the server)."""


class _Retry(Exception):
    """A connection attempt failed in a way worth retrying (internal to the client);
    ``timed_out``: it ran out of time (says less than an earlier attempt's failure)."""

    def __init__(self, message: str, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


def _check_generation(generation: int) -> int:
    if not isinstance(generation, int) or not 0 <= generation <= _MAX_GENERATION:
        raise UsageError(f"a store generation is an integer in [0, 2**64), got {generation!r}")
    return generation


def _check_secret(secret: object) -> bytes:
    if not isinstance(secret, bytes | bytearray):
        raise UsageError(f"the store's secret is bytes, got {type(secret).__name__}")
    return bytes(secret)


def _show(key: str) -> str:
    """``repr(key)``, shortened for messages."""
    return repr(key) if len(key) <= _SHOWN_KEY else repr(key[:_SHOWN_KEY]) + "..."


def _encode_key(key: str) -> bytes:
    if not isinstance(key, str):
        raise UsageError(f"store keys are str, got {type(key).__name__}")
    raw = key.encode("utf-8")
    if len(raw) > MAX_KEY_BYTES:
        raise UsageError(f"store key of {len(raw)} UTF-8 bytes is longer than {MAX_KEY_BYTES}")
    return _U16.pack(len(raw)) + raw


def _encode_keys(keys: Sequence[str]) -> bytes:
    if len(keys) > 0xFFFF:
        raise UsageError(f"at most 65535 keys per request, got {len(keys)}")
    return _U16.pack(len(keys)) + b"".join(_encode_key(k) for k in keys)


def _decode_key(body: memoryview, pos: int) -> tuple[str, int]:
    if pos + 2 > len(body):
        raise _Malformed("truncated key")
    (n,) = _U16.unpack_from(body, pos)
    pos += 2
    if pos + n > len(body):
        raise _Malformed("truncated key")
    try:
        return bytes(body[pos:pos + n]).decode("utf-8"), pos + n
    except UnicodeDecodeError as exc:
        raise _Malformed("key is not UTF-8") from exc


def _decode_keys(body: memoryview, pos: int) -> tuple[list[str], int]:
    if pos + 2 > len(body):
        raise _Malformed("truncated key list")
    (count,) = _U16.unpack_from(body, pos)
    pos += 2
    keys = []
    for _ in range(count):
        key, pos = _decode_key(body, pos)
        keys.append(key)
    return keys, pos


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    """Read exactly ``n`` bytes from a blocking socket (the client side).

    Raises ConnectionError when the peer closes the connection first (the message says after
    how many bytes), TimeoutError at the socket's timeout, OSError for other failures."""
    return recv_bytes(sock, n)


def _timeout_ms(deadline: float) -> int:
    left = deadline - time.monotonic()
    return max(0, min(_MAX_TIMEOUT_MS, math.ceil(left * 1000.0)))


# -- server ------------------------------------------------------------------------------------

# Heap entry kinds.
_K_CONN = 0  # a connection's read/write/handshake deadline
_K_WAITER = 1  # a parked request's timeout
_K_LISTEN = 2  # the end of an accept back-off


class _Conn:
    """One accepted connection (owned by the loop thread)."""

    __slots__ = ("accepted", "authed", "client_nonce", "deadline", "events", "msg_start",
                 "nonce", "open", "peer", "rbuf", "reply_since", "sock", "waiter", "wbytes",
                 "wq")

    def __init__(self, sock: socket.socket, peer: str, now: float) -> None:
        self.sock = sock
        self.peer = peer
        self.nonce = auth.new_nonce()
        self.client_nonce: bytes | None = None  # read: the server's proof is on its way
        self.authed = False
        self.open = True
        self.rbuf = bytearray()
        self.wq: collections.deque[memoryview] = collections.deque()
        self.wbytes = 0
        self.waiter: _Waiter | None = None
        self.accepted = now
        self.msg_start = now
        self.reply_since = now
        self.deadline: float | None = None
        self.events = selectors.EVENT_READ

    @property
    def busy(self) -> bool:
        """A request of this connection is parked or its reply is not fully sent."""
        return self.waiter is not None or self.wbytes > 0


@dataclass(slots=True, eq=False)
class _Waiter:
    """A parked GET or WAIT (owned by the loop thread)."""

    conn: _Conn
    keys: list[str]
    missing: set[str]
    is_get: bool
    deadline: float
    done: bool = False


_LISTEN: Final = "listen"
_WAKE: Final = "wake"

_HeapEntry = tuple[float, int, int, "_Conn | _Waiter | None"]


class StoreServer:
    """The store's server: a listening socket served by one selector-loop thread.

    ``StoreServer(host, port, secret=..., generation=0, hint="")`` binds ``(host, port)``
    (``port=0`` picks a free port, see :attr:`port`) and starts serving at once. When ``host``
    is not an address of this machine the server binds the wildcard address of the same family
    instead. ``secret`` is the job's secret (bytes, may be empty for an insecure job): every
    client must prove it knows it. ``generation`` (an integer in ``[0, 2**64)``) is announced to
    clients and covered by the proofs; ``hint`` (at most :data:`MAX_HINT_BYTES` UTF-8 bytes) is
    announced to clients that were given no secret (the path of the job's secret file).
    ``auth_seconds`` and ``io_seconds`` override :data:`AUTH_SECONDS` and :data:`IO_SECONDS`
    (tests use short ones); ``max_keys``, ``max_stored_bytes`` and ``max_pending_auth``
    override :data:`MAX_KEYS`, :data:`MAX_STORED_BYTES` and :data:`MAX_PENDING_AUTH`
    (integers >= 1). The other limits are the module constants.

    Raises :class:`~bitcoll.errors.CommError` when the address cannot be bound (for example the
    port is in use), UsageError for bad arguments. :meth:`close` stops the server; it is
    idempotent and returns within a few seconds whatever the clients do.
    """

    def __init__(self, host: str, port: int, *, secret: bytes, generation: int = 0,
                 hint: str = "", backlog: int = 128, auth_seconds: float = AUTH_SECONDS,
                 io_seconds: float = IO_SECONDS, max_keys: int = MAX_KEYS,
                 max_stored_bytes: int = MAX_STORED_BYTES,
                 max_pending_auth: int = MAX_PENDING_AUTH) -> None:
        self._secret = _check_secret(secret)
        self._generation = _check_generation(generation)
        if not isinstance(hint, str):
            raise UsageError(f"the store's hint is a str, got {type(hint).__name__}")
        self._hint = hint.encode("utf-8")
        if len(self._hint) > MAX_HINT_BYTES:
            raise UsageError(f"the store's hint of {len(self._hint)} UTF-8 bytes is longer "
                             f"than {MAX_HINT_BYTES}")
        if not (auth_seconds > 0 and io_seconds > 0):
            raise UsageError("auth_seconds and io_seconds must be positive")
        self._auth_seconds = float(auth_seconds)
        self._io_seconds = float(io_seconds)
        for name, value in (("max_keys", max_keys), ("max_stored_bytes", max_stored_bytes),
                            ("max_pending_auth", max_pending_auth)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(f"{name} must be an integer >= 1, got {value!r}")
        self._max_keys = max_keys
        self._max_stored = max_stored_bytes
        self._max_pending = max_pending_auth

        # Loop-thread state.
        self._data: dict[str, bytes] = {}
        self._stored = 0  # UTF-8 key bytes + value bytes in _data
        self._waiters: dict[str, dict[_Waiter, None]] = {}
        self._num_waiters = 0
        self._conns: set[_Conn] = set()
        self._pending: dict[_Conn, None] = {}  # unauthenticated, oldest first
        self._dirty: dict[_Conn, None] = {}  # connections to re-examine at the end of a round
        self._heap: list[_HeapEntry] = []
        self._seq = itertools.count()
        self._paused_until: float | None = None  # accepting is paused until then
        self._paused_full = False  # ... because MAX_PENDING_AUTH connections are young
        self._backoff = _ACCEPT_BACKOFF[0]
        # Age at which an unauthenticated connection may be evicted to make room: a client of
        # the job answers the greeting within milliseconds, a slow stranger does not.
        self._evict_after = min(1.0, self._auth_seconds / 2)
        self._scratch = bytearray(_READ_CHUNK)
        self._scratch_view = memoryview(self._scratch)

        # Shared with other threads.
        self._cond = threading.Condition()
        self._authed = 0
        self._close_called = False
        self._closing = False

        self._listener = self._bind(host, port, backlog)
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        opened: list[socket.socket | selectors.BaseSelector] = [self._listener]
        try:
            self._listener.setblocking(False)
            self._wake_r, self._wake_w = socket.socketpair()
            opened += [self._wake_r, self._wake_w]
            self._wake_r.setblocking(False)
            self._wake_w.setblocking(False)
            self._sel = selectors.DefaultSelector()
            opened.append(self._sel)
            self._sel.register(self._listener, selectors.EVENT_READ, _LISTEN)
            self._sel.register(self._wake_r, selectors.EVENT_READ, _WAKE)
            self._listen_poll = select.poll()  # "does a connection wait in the backlog?"
            self._listen_poll.register(self._listener, select.POLLIN)
            self._thread = threading.Thread(target=self._run, name="bitcoll-store", daemon=True)
            self._thread.start()
        except (OSError, RuntimeError) as exc:  # EMFILE, or no thread can start
            for thing in opened:
                with contextlib.suppress(OSError):
                    thing.close()
            raise CommError(f"cannot serve the rendezvous store on {host}:{port}: {exc}") from exc

    @staticmethod
    def _bind(host: str, port: int, backlog: int) -> socket.socket:
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                       flags=socket.AI_PASSIVE)
        except socket.gaierror as exc:
            raise CommError(f"cannot resolve the store address {host!r}: {exc}") from exc
        family, _, _, _, sockaddr = infos[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(sockaddr)
            except OSError as exc:
                if exc.errno != errno.EADDRNOTAVAIL:
                    raise
                # ``host`` is not local (NAT, a name resolving elsewhere): listen everywhere.
                sock.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", port))
            sock.listen(backlog)
        except OSError as exc:
            sock.close()
            raise CommError(f"cannot serve the rendezvous store on {host}:{port}: {exc}") from exc
        return sock

    @property
    def port(self) -> int:
        """The TCP port the server listens on."""
        return self.address[1]

    @property
    def generation(self) -> int:
        """The generation this server announces."""
        return self._generation

    @property
    def num_clients(self) -> int:
        """How many authenticated clients are connected right now."""
        with self._cond:
            return self._authed

    def wait_idle(self, deadline: float) -> bool:
        """Block until no authenticated client is connected (strangers do not count) or
        ``deadline`` passes; return True if idle (also once the server is closed)."""
        with self._cond:
            while self._authed and not self._close_called:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def close(self) -> None:
        """Stop serving: the loop closes the listener and every connection (clients see the
        connection end), then exits; this waits for it at most a few seconds. Idempotent."""
        with self._cond:
            if self._close_called:
                return
            self._close_called = True
            self._closing = True
            self._cond.notify_all()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\x00")
        if threading.current_thread() is not self._thread:
            self._thread.join(_CLOSE_JOIN_SECONDS)
            if self._thread.is_alive():
                log.warning("store %s: the server thread did not stop within %.0f s",
                            self.port, _CLOSE_JOIN_SECONDS)

    def __enter__(self) -> StoreServer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # -- the loop ----------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._closing:
                try:
                    self._round()
                except Exception:  # a bug: keep serving the others
                    log.exception("store %s: unexpected error in the server loop", self.port)
                    time.sleep(0.01)  # no busy loop should the error repeat
        finally:
            self._teardown()

    def _round(self) -> None:
        timeout: float | None = None
        if self._heap:
            timeout = min(max(0.0, self._heap[0][0] - time.monotonic()), _MAX_SELECT_SECONDS)
        accept = False
        for key, mask in self._sel.select(timeout):
            if self._closing:
                return
            data = key.data
            if data is _LISTEN:
                accept = True  # after the handshakes that this round completes
            elif data is _WAKE:
                with contextlib.suppress(OSError):
                    self._wake_r.recv(64)
            else:
                conn: _Conn = data
                try:
                    if mask & selectors.EVENT_WRITE and conn.open:
                        self._flush(conn)
                    if mask & selectors.EVENT_READ and conn.open:
                        self._on_readable(conn)
                except Exception:
                    log.exception("store %s: unexpected error serving %s", self.port, conn.peer)
                    self._drop(conn, "internal error")
                self._dirty[conn] = None
        if accept:
            self._accept()
        self._expire(time.monotonic())
        self._settle()

    def _settle(self) -> None:
        """Re-examine changed connections: run their queued requests, update their selector
        interest and deadline (answering one request may change others: loop)."""
        while self._dirty:
            conn = next(iter(self._dirty))
            del self._dirty[conn]
            if not conn.open:
                continue
            try:
                self._progress(conn)
            except Exception:
                log.exception("store %s: unexpected error serving %s", self.port, conn.peer)
                self._drop(conn, "internal error")

    def _teardown(self) -> None:
        for conn in list(self._conns):
            self._drop(conn, "the server is closing")
        for sock in (self._listener, self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                sock.close()
        with contextlib.suppress(OSError):
            self._sel.close()
        with self._cond:
            self._closing = True
            self._cond.notify_all()

    # -- deadlines ---------------------------------------------------------------------------

    def _push(self, when: float, kind: int, obj: _Conn | _Waiter | None) -> None:
        heap = self._heap
        if len(heap) > 1024 and len(heap) > 4 * (len(self._conns) + self._num_waiters + 1):
            heap[:] = [e for e in heap if self._live(e)]  # drop stale entries
            heapq.heapify(heap)
        heapq.heappush(heap, (when, next(self._seq), kind, obj))

    def _live(self, entry: _HeapEntry) -> bool:
        when, _, kind, obj = entry
        if kind == _K_CONN:
            return isinstance(obj, _Conn) and obj.open and obj.deadline == when
        if kind == _K_WAITER:
            return isinstance(obj, _Waiter) and not obj.done
        return self._paused_until == when

    def _expire(self, now: float) -> None:
        heap = self._heap
        while heap and heap[0][0] <= now:
            entry = heapq.heappop(heap)
            if not self._live(entry):
                continue
            obj = entry[3]
            if isinstance(obj, _Conn):
                self._drop(obj, self._late_reason(obj))
            elif isinstance(obj, _Waiter):
                self._finish(obj, ST_TIMEOUT)
            else:
                self._resume_accepting()

    def _late_reason(self, conn: _Conn) -> str:
        if not conn.authed:
            return f"no handshake within {self._auth_seconds:g} s"
        if conn.wbytes:
            return f"did not read its reply within {self._io_seconds:g} s"
        return f"did not complete a message within {self._io_seconds:g} s"

    def _update(self, conn: _Conn) -> None:
        """Set the connection's selector interest and deadline from its state."""
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.wq else 0)
        if events != conn.events:
            self._sel.modify(conn.sock, events, conn)
            conn.events = events
        deadline: float | None
        if not conn.authed:
            deadline = conn.accepted + self._auth_seconds
        elif conn.wbytes:
            deadline = conn.reply_since + self._io_seconds
        elif conn.waiter is not None or not conn.rbuf:
            deadline = None
        else:
            deadline = conn.msg_start + self._io_seconds
        if deadline != conn.deadline:
            conn.deadline = deadline
            if deadline is not None:
                self._push(deadline, _K_CONN, conn)

    # -- connections -------------------------------------------------------------------------

    def _accept(self) -> None:
        for _ in range(_ACCEPT_BATCH):
            if len(self._pending) >= self._max_pending and (
                    not self._listen_poll.poll(0) or not self._make_room()):
                return  # nobody waits in the backlog, or nobody may be evicted yet
            try:
                sock, addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.ECONNABORTED, errno.EPROTO, errno.ECONNRESET):
                    log.debug("store %s: accept: %s", self.port, exc)
                    continue
                self._accept_failed(exc)
                return
            self._backoff = _ACCEPT_BACKOFF[0]
            try:
                self._add(sock, addr)
            except Exception as exc:
                if isinstance(exc, OSError):
                    log.debug("store %s: cannot set up a connection from %s: %s", self.port,
                              addr, exc)
                else:
                    log.exception("store %s: cannot set up a connection from %s", self.port,
                                  addr)
                with contextlib.suppress(OSError):
                    sock.close()

    def _make_room(self) -> bool:
        """With MAX_PENDING_AUTH unauthenticated connections: evict the oldest if it is old
        enough and return True; else pause accepting (new connections wait in the kernel's
        backlog) until it is, or until a handshake ends, and return False."""
        oldest = next(iter(self._pending))
        age = time.monotonic() - oldest.accepted
        if age >= self._evict_after:
            self._drop(oldest, f"evicted after {age:.1f} s: {self._max_pending} "
                               "unauthenticated connections are waiting")
            return True
        self._pause_accepting(oldest.accepted + self._evict_after, full=True)
        return False

    def _pause_accepting(self, until: float, full: bool = False) -> None:
        if self._paused_until is None:
            with contextlib.suppress(OSError, ValueError, KeyError):
                self._sel.unregister(self._listener)
        self._paused_until = until
        self._paused_full = full
        self._push(until, _K_LISTEN, None)

    def _resume_accepting(self) -> None:
        if self._paused_until is None:
            return
        self._paused_until = None
        self._paused_full = False
        with contextlib.suppress(OSError, ValueError, KeyError):
            self._sel.register(self._listener, selectors.EVENT_READ, _LISTEN)

    def _accept_failed(self, exc: OSError) -> None:
        log.debug("store %s: accept failed (%s); pausing accepts for %.2f s", self.port, exc,
                  self._backoff)
        if exc.errno in (errno.EMFILE, errno.ENFILE) and self._pending:
            self._drop(next(iter(self._pending)), "evicted: the server is out of descriptors")
        self._pause_accepting(time.monotonic() + self._backoff)
        self._backoff = min(self._backoff * 2, _ACCEPT_BACKOFF[1])

    def _add(self, sock: socket.socket, addr: object) -> None:
        sock.setblocking(False)
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peer = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) and len(addr) >= 2 \
            else str(addr)
        conn = _Conn(sock, peer, time.monotonic())
        self._sel.register(sock, selectors.EVENT_READ, conn)
        self._conns.add(conn)
        self._pending[conn] = None
        self._queue(conn, _GREETING.pack(MAGIC, PROTOCOL_VERSION, len(self._hint),
                                         self._generation, conn.nonce), self._hint)
        self._dirty[conn] = None

    def _drop(self, conn: _Conn, reason: str) -> None:
        if not conn.open:
            return
        conn.open = False
        if conn.waiter is not None:
            self._unpark(conn.waiter)
            conn.waiter = None
        if conn.authed:  # before the peer can see the connection end
            with self._cond:
                self._authed -= 1
                self._cond.notify_all()
        else:
            self._pending.pop(conn, None)
            if self._paused_full:  # room for a connection waiting in the backlog
                self._resume_accepting()
        with contextlib.suppress(OSError, ValueError, KeyError):
            self._sel.unregister(conn.sock)
        with contextlib.suppress(OSError):
            conn.sock.close()
        conn.wq.clear()
        conn.wbytes = 0
        conn.rbuf = bytearray()
        self._conns.discard(conn)
        self._dirty.pop(conn, None)
        log.debug("store %s: dropped the connection from %s: %s", self.port, conn.peer, reason)

    def _queue(self, conn: _Conn, *parts: bytes) -> None:
        """Queue bytes for ``conn`` and send what the socket takes now."""
        if not conn.wq:
            conn.reply_since = time.monotonic()
        for part in parts:
            if part:
                conn.wq.append(memoryview(part))
                conn.wbytes += len(part)
        self._flush(conn)

    def _reply(self, conn: _Conn, status: int, payload: bytes = b"") -> None:
        self._queue(conn, _U32.pack(1 + len(payload)) + bytes([status]), payload)
        self._dirty[conn] = None

    def _flush(self, conn: _Conn) -> None:
        wq = conn.wq
        had = bool(wq)
        while wq:
            try:
                sent = conn.sock.sendmsg(list(itertools.islice(wq, 8)))
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                self._drop(conn, f"send failed: {exc}")
                return
            conn.wbytes -= sent
            while sent:
                head = wq[0]
                if sent >= len(head):
                    sent -= len(head)
                    wq.popleft()
                else:
                    wq[0] = head[sent:]
                    sent = 0
        if had and not wq:
            conn.msg_start = time.monotonic()  # the reply is out: the client's turn now
        self._dirty[conn] = None

    def _on_readable(self, conn: _Conn) -> None:
        if conn.authed:
            want = min(_READ_CHUNK, 4 + MAX_BODY - len(conn.rbuf))
            if want <= 0:  # a full message is waiting behind a pending request
                self._drop(conn, "sent a request before the previous one was answered")
                return
        else:  # the client's nonce, then its proof
            want = (auth.NONCE_BYTES if conn.client_nonce is None
                    else auth.MAC_BYTES) - len(conn.rbuf)
        try:
            n = conn.sock.recv_into(self._scratch_view, want)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._drop(conn, f"receive failed: {exc}")
            return
        if n == 0:
            self._flush(conn)  # best effort: an answer for a client that only half-closed
            self._drop(conn, "the peer closed the connection" if conn.authed
                       else "the peer closed the connection during the handshake")
            return
        if not conn.rbuf:
            conn.msg_start = time.monotonic()
        conn.rbuf += self._scratch_view[:n]
        if conn.authed:
            return
        if conn.client_nonce is None and len(conn.rbuf) == auth.NONCE_BYTES:
            conn.client_nonce = bytes(conn.rbuf)
            conn.rbuf = bytearray()
            self._queue(conn, auth.mac(self._secret, "store-server", conn.nonce,
                                       conn.client_nonce, self._generation))
        elif conn.client_nonce is not None and len(conn.rbuf) == auth.MAC_BYTES:
            self._authenticate(conn)

    def _authenticate(self, conn: _Conn) -> None:
        client_nonce = conn.client_nonce
        assert client_nonce is not None
        proof = bytes(conn.rbuf)
        conn.rbuf = bytearray()
        if not auth.verify(self._secret, proof, "store-client", conn.nonce, client_nonce,
                           self._generation):
            if not conn.wq:
                with contextlib.suppress(OSError):
                    conn.sock.send(bytes([_AUTH_REJECTED]))
            self._drop(conn, "wrong proof of the job's secret")
            return
        conn.authed = True
        del self._pending[conn]
        if self._paused_full:
            self._resume_accepting()
        with self._cond:
            self._authed += 1
            self._cond.notify_all()
        self._queue(conn, bytes([_AUTH_OK]))
        log.debug("store %s: authenticated %s", self.port, conn.peer)

    def _progress(self, conn: _Conn) -> None:
        """Run the connection's complete requests while it is not busy, then update it."""
        while conn.open and conn.authed and not conn.busy and len(conn.rbuf) >= 4:
            (n,) = _U32.unpack_from(conn.rbuf, 0)
            if n > MAX_BODY:
                self._drop(conn, f"announced a message of {n} bytes, over the limit of "
                                 f"{MAX_BODY}")
                return
            if len(conn.rbuf) < 4 + n:
                break
            body = bytes(conn.rbuf[4:4 + n])
            del conn.rbuf[:4 + n]
            conn.msg_start = time.monotonic()
            try:
                self._handle(conn, memoryview(body))
            except _Malformed as exc:
                self._reply(conn, ST_ERROR, f"malformed request: {exc}".encode())
        if conn.open:
            self._update(conn)

    # -- requests ----------------------------------------------------------------------------

    def _handle(self, conn: _Conn, body: memoryview) -> None:
        if len(body) < 1:
            raise _Malformed("empty request")
        op = body[0]
        if op == OP_SET:
            key, pos = _decode_key(body, 1)
            self._set(conn, key, bytes(body[pos:]))
        elif op in (OP_GET, OP_WAIT):
            if len(body) < 5:
                raise _Malformed("truncated GET" if op == OP_GET else "truncated WAIT")
            (timeout_ms,) = _U32.unpack_from(body, 1)
            if op == OP_GET:
                key, pos = _decode_key(body, 5)
                keys = [key]
            else:
                keys, pos = _decode_keys(body, 5)
            if pos != len(body):
                raise _Malformed("trailing bytes")
            self._get_or_wait(conn, keys, op == OP_GET, timeout_ms)
        elif op == OP_ADD:
            if len(body) < 9:
                raise _Malformed("truncated ADD")
            (delta,) = _I64.unpack_from(body, 1)
            key, pos = _decode_key(body, 9)
            if pos != len(body):
                raise _Malformed("trailing bytes")
            self._add_to(conn, key, delta)
        elif op == OP_MISSING:
            keys, pos = _decode_keys(body, 1)
            if pos != len(body):
                raise _Malformed("trailing bytes")
            self._reply(conn, ST_OK, _encode_keys([k for k in keys if k not in self._data]))
        else:
            raise _Malformed(f"unknown opcode {op}")

    def _error(self, conn: _Conn, message: str) -> None:
        self._reply(conn, ST_ERROR, message.encode("utf-8"))

    def _store(self, conn: _Conn, key: str, value: bytes) -> bool:
        """Store ``value`` under ``key`` within the caps, or reply ERROR and return False."""
        old = self._data.get(key)
        key_bytes = len(key.encode("utf-8"))
        if old is None and len(self._data) >= self._max_keys:
            self._error(conn, f"the store is full: it holds {len(self._data)} keys, the "
                              f"most it holds; cannot add {_show(key)}")
            return False
        stored = self._stored + key_bytes + len(value)
        if old is not None:
            stored -= key_bytes + len(old)
        if stored > self._max_stored:
            self._error(conn, f"the store is full: storing {len(value)} bytes under "
                              f"{_show(key)} would exceed its {self._max_stored} bytes")
            return False
        self._data[key] = value
        self._stored = stored
        return True

    def _set(self, conn: _Conn, key: str, value: bytes) -> None:
        if len(value) > MAX_VALUE:
            self._error(conn, f"set: a value of {len(value)} bytes is larger than the limit "
                              f"of {MAX_VALUE}")
            return
        if self._store(conn, key, value):
            self._reply(conn, ST_OK)
            self._satisfy(key)

    def _add_to(self, conn: _Conn, key: str, delta: int) -> None:
        old = self._data.get(key, b"0")
        try:
            value = int(old.decode("ascii")) + delta
        except (UnicodeDecodeError, ValueError):
            self._error(conn, f"add: key {_show(key)} does not hold a decimal integer")
            return
        if not -(1 << 63) <= value < (1 << 63):
            self._error(conn, f"add: key {_show(key)} overflows int64")
            return
        if self._store(conn, key, str(value).encode("ascii")):
            self._reply(conn, ST_OK, _I64.pack(value))
            self._satisfy(key)

    def _get_or_wait(self, conn: _Conn, keys: list[str], is_get: bool, timeout_ms: int) -> None:
        missing = {k for k in keys if k not in self._data}
        if not missing or timeout_ms == 0:
            self._answer(conn, keys, is_get, ST_TIMEOUT if missing else ST_OK)
            return
        w = _Waiter(conn, keys, missing, is_get, time.monotonic() + timeout_ms / 1000.0)
        conn.waiter = w
        for k in missing:
            self._waiters.setdefault(k, {})[w] = None
        self._num_waiters += 1
        self._push(w.deadline, _K_WAITER, w)

    def _answer(self, conn: _Conn, keys: list[str], is_get: bool, status: int) -> None:
        if is_get:
            self._reply(conn, status, self._data[keys[0]] if status == ST_OK else b"")
        elif status == ST_OK:
            self._reply(conn, ST_OK)
        else:
            self._reply(conn, ST_TIMEOUT, _encode_keys([k for k in keys if k not in self._data]))

    def _satisfy(self, key: str) -> None:
        """Answer the parked requests that the new ``key`` completes."""
        waiters = self._waiters.pop(key, None)
        if not waiters:
            return
        for w in waiters:
            w.missing.discard(key)
            if not w.missing and not w.done:
                self._finish(w, ST_OK)

    def _unpark(self, w: _Waiter) -> None:
        if w.done:
            return
        w.done = True
        self._num_waiters -= 1
        for k in w.missing:
            lst = self._waiters.get(k)
            if lst is not None:
                lst.pop(w, None)
                if not lst:
                    del self._waiters[k]

    def _finish(self, w: _Waiter, status: int) -> None:
        self._unpark(w)
        conn = w.conn
        conn.waiter = None
        if conn.open:
            self._answer(conn, w.keys, w.is_get, status)


# -- client ------------------------------------------------------------------------------------


class StoreClient:
    """An authenticated connection to a :class:`StoreServer`. Thread-safe: requests are
    serialized.

    Create it with :meth:`connect`. Operations called without a ``deadline`` use
    ``time.monotonic() + default_timeout``. After a timeout or a broken connection the client
    is unusable (the reply stream may be out of step) and every later call raises
    :class:`~bitcoll.errors.PeerLostError`.
    """

    def __init__(self, sock: socket.socket, address: tuple[str, int],
                 default_timeout: float = DEFAULT_TIMEOUT, *, secret: bytes = b"",
                 generation: int = 0) -> None:
        self._sock = sock
        self.address = address
        self.default_timeout = default_timeout
        self._secret = bytes(secret)
        self.generation = generation
        self._lock = threading.Lock()
        self._broken: str | None = None

    @classmethod
    def connect(cls, host: str, port: int, deadline: float, *, secret: bytes | None,
                generation: int = 0, default_timeout: float = DEFAULT_TIMEOUT) -> StoreClient:
        """Connect to the store at ``host:port`` and authenticate, retrying until ``deadline``.

        ``secret`` is the job's secret; None means "read it from the file the store names"
        (its greeting's hint, see :func:`bitcoll.transport.auth.read_secret_file`).
        ``generation`` is the generation of the store this process expects.

        Retries refused connections, stores of an earlier generation (still closing), processes
        that cannot prove they know the secret and stores that reject this process's proof.
        Raises :class:`~bitcoll.errors.CommTimeoutError` at the deadline (the message says why
        the last attempt failed); UsageError at once when the store is of a later generation
        (this process is behind), when ``secret`` is None and the store names no secret file,
        or when the named file cannot be used.
        """
        _check_generation(generation)
        if secret is not None:
            secret = _check_secret(secret)
        backoff = Backoff()
        last = ""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise CommTimeoutError(
                    f"no rendezvous store answered at {host}:{port} before the deadline "
                    f"(last attempt: {last or 'no attempt was made'})")
            try:
                sock = socket.create_connection((host, port),
                                                timeout=min(left, _ATTEMPT_SECONDS))
            except OSError as exc:
                if not (isinstance(exc, TimeoutError) and last):
                    last = str(exc)
            else:
                try:
                    used = cls._handshake(sock, f"{host}:{port}", secret, generation,
                                          min(deadline, time.monotonic() + _ATTEMPT_SECONDS))
                except _Retry as exc:
                    sock.close()
                    log.debug("store client: %s; retrying", exc)
                    if not (exc.timed_out and last):  # keep the reason the deadline cut short
                        last = str(exc)
                except BaseException:
                    sock.close()
                    raise
                else:
                    return cls(sock, (host, port), default_timeout, secret=used,
                               generation=generation)
            backoff.sleep(deadline)

    @staticmethod
    def _handshake(sock: socket.socket, where: str, secret: bytes | None, generation: int,
                   deadline: float) -> bytes:
        """Run the client's side of the handshake; return the secret used.

        Raises _Retry for failures worth another attempt, UsageError for the others."""

        def recv(n: int) -> bytes:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            sock.settimeout(left)
            return _recv_exact(sock, n)

        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            magic, version, hint_len, gen, server_nonce = _GREETING.unpack(
                recv(_GREETING.size))
            if magic != MAGIC:
                raise _Retry(f"the process at {where} is not a bitcoll rendezvous store "
                             "(unexpected greeting)")
            if version != PROTOCOL_VERSION:
                raise _Retry(f"the store at {where} speaks store protocol {version}, this "
                             f"process speaks {PROTOCOL_VERSION}")
            raw_hint = recv(hint_len)
            if gen < generation:
                raise _Retry(f"the store at {where} belongs to an earlier communicator of "
                             f"this job (generation {gen} < {generation}) and is closing")
            if secret is None:
                try:
                    hint = raw_hint.decode("utf-8")
                except UnicodeDecodeError:
                    raise _Retry(f"the process at {where} sent a hint that is not "
                                 "UTF-8") from None
                if not hint:
                    raise UsageError(
                        f"the store at {where} names no secret file and this process was "
                        f"given no secret: set {auth.SECRET_ENV} to the same non-empty string "
                        "on every rank", argument=auth.SECRET_ENV)
                secret = auth.read_secret_file(hint)
            client_nonce = auth.new_nonce()
            sock.settimeout(max(1e-3, deadline - time.monotonic()))
            sock.sendall(client_nonce)
            # The store proves itself first: nothing of this process's proof goes to a
            # process that cannot.
            if not auth.verify(secret, recv(auth.MAC_BYTES), "store-server", server_nonce,
                               client_nonce, gen):
                raise _Retry(f"the process at {where} could not prove it knows the job's "
                             "secret (it is not this job's store, or the ranks were given "
                             "different secrets)")
            sock.settimeout(max(1e-3, deadline - time.monotonic()))
            sock.sendall(auth.mac(secret, "store-client", server_nonce, client_nonce, gen))
            status = recv(1)[0]
            if status == _AUTH_REJECTED:
                raise _Retry(f"the store at {where} rejected this process's proof: this "
                             "process does not know the job's secret (were the ranks given "
                             "different secrets?)")
            if status != _AUTH_OK:
                raise _Retry(f"the process at {where} answered the handshake with an unknown "
                             f"status {status}")
        except TimeoutError:
            raise _Retry(f"the process at {where} did not complete the handshake in time",
                         timed_out=True) from None
        except OSError as exc:  # ConnectionError included
            raise _Retry(f"the connection to {where} broke during the handshake "
                         f"({exc})") from None
        if gen > generation:
            raise UsageError(f"the store at {where} belongs to a later communicator of this "
                             f"job (generation {gen} > {generation}): this process is behind",
                             argument="generation")
        return secret

    @property
    def secret(self) -> bytes:
        """The job's secret this client authenticated with (given or read from the hint)."""
        return self._secret

    @property
    def local_address(self) -> str:
        """The local IP address this client uses to reach the server."""
        return str(self._sock.getsockname()[0])

    @property
    def family(self) -> socket.AddressFamily:
        """The address family of the connection to the server."""
        return self._sock.family

    def close(self) -> None:
        """Close the connection. Idempotent."""
        with self._lock:
            if self._broken is None:
                self._broken = "the store client is closed"
            with contextlib.suppress(OSError):
                self._sock.close()

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _deadline(self, deadline: float | None) -> float:
        return time.monotonic() + self.default_timeout if deadline is None else deadline

    def _request(self, body: bytes, deadline: float, what: str, grace: float = 0.0,
                 argument: str | None = None) -> bytes:
        """Send one request and return the reply body (status byte first); ``argument``: the
        argument of ``what`` that makes the body too long, if one can."""
        if len(body) > MAX_BODY:
            raise UsageError(f"store {what}: a request of {len(body)} bytes is larger than the "
                             f"limit of {MAX_BODY}", argument=argument)
        where = f"{self.address[0]}:{self.address[1]}"
        with self._lock:
            if self._broken is not None:
                raise PeerLostError(f"store at {where}: {self._broken}")
            left = deadline - time.monotonic() + grace
            if left <= 0:
                raise CommTimeoutError(f"store {what}: the deadline passed")
            try:
                self._sock.settimeout(left)
                self._sock.sendall(_U32.pack(len(body)) + body)
                (n,) = _U32.unpack(_recv_exact(self._sock, 4))
                if n > MAX_BODY or n == 0:
                    raise ConnectionError(f"a malformed reply of {n} bytes")
                reply = _recv_exact(self._sock, n)
            except TimeoutError as exc:
                self._broken = f"a {what} request timed out"
                raise CommTimeoutError(f"store {what}: no answer from the store at {where} "
                                       "before the deadline") from exc
            except OSError as exc:
                self._broken = f"connection lost ({exc})"
                raise PeerLostError(f"lost the connection to the store at {where} during "
                                    f"{what}: {exc}") from exc
        if reply[0] == ST_ERROR:
            raise UsageError(f"store {what}: {reply[1:].decode('utf-8', 'replace')}")
        return reply

    def set(self, key: str, value: bytes, deadline: float | None = None) -> None:
        """Store ``value`` under ``key`` (UsageError for a value longer than
        :data:`MAX_VALUE` or a full store)."""
        value = bytes(value)
        if len(value) > MAX_VALUE:
            raise UsageError(f"store set({_show(key)}): a value of {len(value)} bytes is "
                             f"larger than the limit of {MAX_VALUE}", argument="value")
        self._request(bytes([OP_SET]) + _encode_key(key) + value,
                      self._deadline(deadline), f"set({_show(key)})")

    def get(self, key: str, deadline: float | None = None) -> bytes:
        """Return the value of ``key``, waiting until it is set or ``deadline`` passes
        (then :class:`~bitcoll.errors.CommTimeoutError`)."""
        dl = self._deadline(deadline)
        while True:
            reply = self._request(bytes([OP_GET]) + _U32.pack(_timeout_ms(dl))
                                  + _encode_key(key), dl, f"get({_show(key)})", _REPLY_GRACE)
            if reply[0] != ST_TIMEOUT:
                return reply[1:]
            if time.monotonic() >= dl:  # the server's clock may run a little ahead
                raise CommTimeoutError(f"store key {_show(key)} was not set before the "
                                       "deadline")

    def try_get(self, key: str, deadline: float | None = None) -> bytes | None:
        """Return the value of ``key`` or None if it is not set; never waits for the key."""
        reply = self._request(bytes([OP_GET]) + _U32.pack(0) + _encode_key(key),
                              self._deadline(deadline), f"get({_show(key)})")
        return None if reply[0] == ST_TIMEOUT else reply[1:]

    def add(self, key: str, delta: int, deadline: float | None = None) -> int:
        """Atomically add ``delta`` to the counter ``key`` (missing = 0); return the new value."""
        reply = self._request(bytes([OP_ADD]) + _I64.pack(delta) + _encode_key(key),
                              self._deadline(deadline), f"add({_show(key)})")
        if len(reply) != 9:
            raise PeerLostError(f"store add({_show(key)}): malformed reply")
        return int(_I64.unpack_from(reply, 1)[0])

    def wait(self, keys: Iterable[str], deadline: float | None = None) -> None:
        """Block until every key in ``keys`` is set; raise
        :class:`~bitcoll.errors.CommTimeoutError` naming the missing keys at ``deadline``."""
        klist = list(keys)
        dl = self._deadline(deadline)
        while True:
            reply = self._request(bytes([OP_WAIT]) + _U32.pack(_timeout_ms(dl))
                                  + _encode_keys(klist), dl, "wait", _REPLY_GRACE, "keys")
            if reply[0] != ST_TIMEOUT:
                return
            if time.monotonic() >= dl:
                missing = self._parse_keys(reply, "wait")
                raise CommTimeoutError(f"store keys never set before the deadline: {missing}")

    def missing(self, keys: Iterable[str], deadline: float | None = None) -> list[str]:
        """Return the keys among ``keys`` that are not set, in order, without waiting."""
        reply = self._request(bytes([OP_MISSING]) + _encode_keys(list(keys)),
                              self._deadline(deadline), "missing", argument="keys")
        return self._parse_keys(reply, "missing")

    @staticmethod
    def _parse_keys(reply: bytes, what: str) -> list[str]:
        try:
            keys, _ = _decode_keys(memoryview(reply), 1)
        except _Malformed as exc:
            raise PeerLostError(f"store {what}: malformed reply ({exc})") from exc
        return keys
