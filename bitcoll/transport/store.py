"""A small rendezvous key-value store over TCP.

Rank 0 of a TCP job runs a :class:`StoreServer` (a background thread); every rank, rank 0
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

Errors: :class:`~bitcoll.errors.CommTimeoutError` when a deadline passes,
:class:`~bitcoll.errors.PeerLostError` when the connection to the server breaks or cannot be
established, :class:`~bitcoll.errors.UsageError` for bad arguments (a key longer than 65535 UTF-8
bytes, ``add`` on a value that is not a decimal integer).

Wire protocol (little-endian, no pickle). Every message is ``u32 body_length`` then the body.
A request body starts with a one-byte opcode; a reply body with a one-byte status
(0 OK, 1 TIMEOUT, 2 ERROR followed by a UTF-8 message). Keys are encoded as
``u16 length + UTF-8 bytes``; timeouts as ``u32`` milliseconds.

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

import contextlib
import errno
import math
import socket
import struct
import threading
import time
from collections.abc import Iterable, Sequence
from types import TracebackType

from ..errors import CommError, CommTimeoutError, PeerLostError, UsageError

__all__ = ["StoreServer", "StoreClient"]

_U32 = struct.Struct("<I")
_U16 = struct.Struct("<H")
_I64 = struct.Struct("<q")

OP_SET = 1
OP_GET = 2
OP_ADD = 3
OP_WAIT = 4
OP_MISSING = 5

ST_OK = 0
ST_TIMEOUT = 1
ST_ERROR = 2

#: Largest message body either side accepts (guards against a stray peer's garbage).
MAX_BODY = 1 << 30
#: Largest timeout a request can carry, in milliseconds.
_MAX_TIMEOUT_MS = 0xFFFFFFFF
#: How much longer than its own deadline a client waits for the server's TIMEOUT answer.
_REPLY_GRACE = 2.0
#: Default deadline of operations called without one, in seconds.
DEFAULT_TIMEOUT = 60.0


class _Malformed(Exception):
    """A request that cannot be decoded (internal to the server)."""


class _Closing(Exception):
    """The server is closing while a request waits (internal to the server)."""


def _encode_key(key: str) -> bytes:
    if not isinstance(key, str):
        raise UsageError(f"store keys are str, got {type(key).__name__}")
    raw = key.encode("utf-8")
    if len(raw) > 0xFFFF:
        raise UsageError(f"store key of {len(raw)} UTF-8 bytes is longer than 65535")
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


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    """Read exactly ``n`` bytes; None on EOF at the start, ConnectionError on EOF inside."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            if got == 0:
                return None
            raise ConnectionError("connection closed in the middle of a message")
        got += k
    return bytes(buf)


def _read_message(sock: socket.socket) -> bytes | None:
    head = _recv_exact(sock, 4)
    if head is None:
        return None
    (n,) = _U32.unpack(head)
    if n > MAX_BODY:
        raise ConnectionError(f"message of {n} bytes exceeds the limit of {MAX_BODY}")
    if n == 0:
        return b""
    body = _recv_exact(sock, n)
    if body is None:
        raise ConnectionError("connection closed in the middle of a message")
    return body


def _timeout_ms(deadline: float) -> int:
    left = deadline - time.monotonic()
    return max(0, min(_MAX_TIMEOUT_MS, math.ceil(left * 1000.0)))


class StoreServer:
    """The store's server: a listening socket and one thread per connected client.

    ``StoreServer(host, port)`` binds ``(host, port)`` (``port=0`` picks a free port, see
    :attr:`port`) and starts serving at once. When ``host`` is not an address of this machine
    the server binds the wildcard address of the same family instead. Raises
    :class:`~bitcoll.errors.CommError` when the address cannot be bound (for example the port
    is in use). :meth:`close` stops the server; it is idempotent.
    """

    def __init__(self, host: str, port: int, *, backlog: int = 128) -> None:
        self._data: dict[str, bytes] = {}
        self._cond = threading.Condition()
        self._clients: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._listener = self._bind(host, port, backlog)
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        self._listener.settimeout(0.5)  # fallback wake-up where shutdown() does not wake accept
        self._acceptor = threading.Thread(target=self._accept_loop, name="bitcoll-store-accept",
                                          daemon=True)
        self._acceptor.start()

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
    def num_clients(self) -> int:
        """How many clients are connected right now."""
        with self._cond:
            return len(self._clients)

    def wait_idle(self, deadline: float) -> bool:
        """Block until no client is connected or ``deadline`` passes; return True if idle."""
        with self._cond:
            while self._clients and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def close(self) -> None:
        """Stop serving: close the listener and every client connection, join the threads."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            clients = list(self._clients)
            self._cond.notify_all()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes accept() on Linux
        self._listener.close()
        for conn in clients:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        self._acceptor.join(5.0)
        for t in list(self._threads):
            t.join(5.0)

    def __enter__(self) -> StoreServer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # -- serving ---------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(None)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._cond:
                if self._is_closed():
                    conn.close()
                    return
                self._clients.add(conn)
                t = threading.Thread(target=self._serve, args=(conn,), daemon=True,
                                     name="bitcoll-store-client")
                self._threads = [x for x in self._threads if x.is_alive()]
                self._threads.append(t)
            t.start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            while True:
                body = _read_message(conn)
                if body is None:
                    return
                try:
                    reply = self._handle(memoryview(body))
                except _Malformed as exc:
                    reply = bytes([ST_ERROR]) + f"malformed request: {exc}".encode()
                except _Closing:
                    return
                conn.sendall(_U32.pack(len(reply)) + reply)
        except OSError:
            return
        finally:
            with self._cond:
                self._clients.discard(conn)
                self._cond.notify_all()
            conn.close()

    def _is_closed(self) -> bool:
        return self._closed

    def _wait_for(self, keys: Sequence[str], timeout_ms: int) -> list[str]:
        """Wait (holding ``_cond``) until every key is present; return the missing ones."""
        deadline = time.monotonic() + timeout_ms / 1000.0
        while True:
            if self._closed:
                raise _Closing
            missing = [k for k in keys if k not in self._data]
            if not missing:
                return missing
            left = deadline - time.monotonic()
            if left <= 0:
                return missing
            self._cond.wait(left)

    def _handle(self, body: memoryview) -> bytes:
        if len(body) < 1:
            raise _Malformed("empty request")
        op = body[0]
        if op == OP_SET:
            key, pos = _decode_key(body, 1)
            with self._cond:
                self._data[key] = bytes(body[pos:])
                self._cond.notify_all()
            return bytes([ST_OK])
        if op == OP_GET:
            if len(body) < 5:
                raise _Malformed("truncated GET")
            (timeout_ms,) = _U32.unpack_from(body, 1)
            key, _ = _decode_key(body, 5)
            with self._cond:
                if self._wait_for([key], timeout_ms):
                    return bytes([ST_TIMEOUT])
                return bytes([ST_OK]) + self._data[key]
        if op == OP_ADD:
            if len(body) < 9:
                raise _Malformed("truncated ADD")
            (delta,) = _I64.unpack_from(body, 1)
            key, _ = _decode_key(body, 9)
            with self._cond:
                old = self._data.get(key, b"0")
                try:
                    value = int(old.decode("ascii")) + delta
                except (UnicodeDecodeError, ValueError):
                    return bytes([ST_ERROR]) + f"add: key {key!r} does not hold a decimal " \
                        "integer".encode()
                if not -(1 << 63) <= value < (1 << 63):
                    return bytes([ST_ERROR]) + f"add: key {key!r} overflows int64".encode()
                self._data[key] = str(value).encode("ascii")
                self._cond.notify_all()
            return bytes([ST_OK]) + _I64.pack(value)
        if op == OP_WAIT:
            if len(body) < 5:
                raise _Malformed("truncated WAIT")
            (timeout_ms,) = _U32.unpack_from(body, 1)
            keys, _ = _decode_keys(body, 5)
            with self._cond:
                missing = self._wait_for(keys, timeout_ms)
            if missing:
                return bytes([ST_TIMEOUT]) + _encode_keys(missing)
            return bytes([ST_OK])
        if op == OP_MISSING:
            keys, _ = _decode_keys(body, 1)
            with self._cond:
                missing = [k for k in keys if k not in self._data]
            return bytes([ST_OK]) + _encode_keys(missing)
        raise _Malformed(f"unknown opcode {op}")


class StoreClient:
    """A connection to a :class:`StoreServer`. Thread-safe: requests are serialized.

    Create it with :meth:`connect`. Operations called without a ``deadline`` use
    ``time.monotonic() + default_timeout``. After a timeout or a broken connection the client
    is unusable (the reply stream may be out of step) and every later call raises
    :class:`~bitcoll.errors.PeerLostError`.
    """

    def __init__(self, sock: socket.socket, address: tuple[str, int],
                 default_timeout: float = DEFAULT_TIMEOUT) -> None:
        self._sock = sock
        self.address = address
        self.default_timeout = default_timeout
        self._lock = threading.Lock()
        self._broken: str | None = None

    @classmethod
    def connect(cls, host: str, port: int, deadline: float, *,
                default_timeout: float = DEFAULT_TIMEOUT) -> StoreClient:
        """Connect to the server at ``host:port``, retrying until ``deadline``.

        Raises :class:`~bitcoll.errors.CommTimeoutError` if no connection could be made before
        the deadline (the message says why the last attempt failed).
        """
        delay = 0.01
        last: Exception | None = None
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise CommTimeoutError(
                    f"no rendezvous store answered at {host}:{port} before the deadline "
                    f"(last attempt: {last})")
            try:
                sock = socket.create_connection((host, port), timeout=min(left, 5.0))
            except OSError as exc:
                last = exc
                time.sleep(max(0.0, min(delay, deadline - time.monotonic())))
                delay = min(delay * 2, 0.25)
                continue
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return cls(sock, (host, port), default_timeout)

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

    def _request(self, body: bytes, deadline: float, what: str, grace: float = 0.0) -> bytes:
        """Send one request and return the reply body (status byte first)."""
        with self._lock:
            if self._broken is not None:
                raise PeerLostError(f"store at {self.address[0]}:{self.address[1]}: "
                                    f"{self._broken}")
            left = deadline - time.monotonic() + grace
            if left <= 0:
                raise CommTimeoutError(f"store {what}: the deadline passed")
            try:
                self._sock.settimeout(left)
                self._sock.sendall(_U32.pack(len(body)) + body)
                reply = _read_message(self._sock)
            except TimeoutError as exc:
                self._broken = f"a {what} request timed out"
                raise CommTimeoutError(f"store {what}: no answer from the store at "
                                       f"{self.address[0]}:{self.address[1]} before the "
                                       "deadline") from exc
            except OSError as exc:
                self._broken = f"connection lost ({exc})"
                raise PeerLostError(f"lost the connection to the store at {self.address[0]}:"
                                    f"{self.address[1]} during {what}: {exc}") from exc
            if reply is None:
                self._broken = "the server closed the connection"
                raise PeerLostError(f"the store at {self.address[0]}:{self.address[1]} "
                                    f"closed the connection during {what}")
        if not reply:
            raise PeerLostError(f"store {what}: empty reply")
        if reply[0] == ST_ERROR:
            raise UsageError(f"store {what}: {reply[1:].decode('utf-8', 'replace')}")
        return reply

    def set(self, key: str, value: bytes, deadline: float | None = None) -> None:
        """Store ``value`` under ``key``."""
        self._request(bytes([OP_SET]) + _encode_key(key) + bytes(value),
                      self._deadline(deadline), f"set({key!r})")

    def get(self, key: str, deadline: float | None = None) -> bytes:
        """Return the value of ``key``, waiting until it is set or ``deadline`` passes
        (then :class:`~bitcoll.errors.CommTimeoutError`)."""
        dl = self._deadline(deadline)
        while True:
            reply = self._request(bytes([OP_GET]) + _U32.pack(_timeout_ms(dl))
                                  + _encode_key(key), dl, f"get({key!r})", _REPLY_GRACE)
            if reply[0] != ST_TIMEOUT:
                return reply[1:]
            if time.monotonic() >= dl:  # the server's clock may run a little ahead
                raise CommTimeoutError(f"store key {key!r} was not set before the deadline")

    def try_get(self, key: str, deadline: float | None = None) -> bytes | None:
        """Return the value of ``key`` or None if it is not set; never waits for the key."""
        reply = self._request(bytes([OP_GET]) + _U32.pack(0) + _encode_key(key),
                              self._deadline(deadline), f"get({key!r})")
        return None if reply[0] == ST_TIMEOUT else reply[1:]

    def add(self, key: str, delta: int, deadline: float | None = None) -> int:
        """Atomically add ``delta`` to the counter ``key`` (missing = 0); return the new value."""
        reply = self._request(bytes([OP_ADD]) + _I64.pack(delta) + _encode_key(key),
                              self._deadline(deadline), f"add({key!r})")
        if len(reply) != 9:
            raise PeerLostError(f"store add({key!r}): malformed reply")
        return int(_I64.unpack_from(reply, 1)[0])

    def wait(self, keys: Iterable[str], deadline: float | None = None) -> None:
        """Block until every key in ``keys`` is set; raise
        :class:`~bitcoll.errors.CommTimeoutError` naming the missing keys at ``deadline``."""
        klist = list(keys)
        dl = self._deadline(deadline)
        while True:
            reply = self._request(bytes([OP_WAIT]) + _U32.pack(_timeout_ms(dl))
                                  + _encode_keys(klist), dl, "wait", _REPLY_GRACE)
            if reply[0] != ST_TIMEOUT:
                return
            if time.monotonic() >= dl:
                missing = self._parse_keys(reply, "wait")
                raise CommTimeoutError(f"store keys never set before the deadline: {missing}")

    def missing(self, keys: Iterable[str], deadline: float | None = None) -> list[str]:
        """Return the keys among ``keys`` that are not set, in order, without waiting."""
        reply = self._request(bytes([OP_MISSING]) + _encode_keys(list(keys)),
                              self._deadline(deadline), "missing")
        return self._parse_keys(reply, "missing")

    @staticmethod
    def _parse_keys(reply: bytes, what: str) -> list[str]:
        try:
            keys, _ = _decode_keys(memoryview(reply), 1)
        except _Malformed as exc:
            raise PeerLostError(f"store {what}: malformed reply ({exc})") from exc
        return keys
