"""Property tests of the rendezvous store's server against arbitrary bytes from its peers.

Whatever a peer sends, before the handshake or after it as requests, the server answers with
well-formed replies (OK, TIMEOUT or ERROR) or drops the connection; no exception escapes its
thread, it never allocates much more than it was sent, it never hangs, and it keeps serving a
good client. Every example ends by half-closing the connection and reading until the server
closes its side, with a deadline.

Allocations are traced (``tracemalloc``) only while an example is on the wire, not while
hypothesis draws it: tracing slows every allocation of the process several-fold, and on a
checkout without hypothesis's cache (``.hypothesis/``, as in CI) the first draw of a text
strategy builds its Unicode tables (a Python loop over every code point, a million tuples):
traced, that took a minute of the suite; untraced, about two seconds.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
import time
import tracemalloc
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from bitcoll.transport.rendezvous import auth, store
from bitcoll.transport.rendezvous.store import StoreClient, StoreServer

pytestmark = pytest.mark.timeout(240)

SECRET = b"fuzz secret"
GREETING = struct.Struct("<4sHHQ16s")
#: Most bytes the process may allocate on top of what it had while one example runs (the
#: examples send at most a few KiB; a server that believed a length prefix would allocate up to
#: 4 GiB).
ALLOC_BOUND = 4 << 20
#: Deadline of every socket operation of an example, in seconds.
IO_DEADLINE = 20.0

FUZZ_SETTINGS = settings(max_examples=100, deadline=None, database=None,
                         suppress_health_check=[HealthCheck.too_slow])


class _Errors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@dataclass
class _Harness:
    server: StoreServer
    good: StoreClient
    errors: _Errors
    escaped: list[BaseException] = field(default_factory=list)

    def check(self) -> None:
        """The server thread lives, logged no error, and still answers a good client."""
        assert self.server._thread.is_alive()
        assert not self.escaped, self.escaped
        assert not self.errors.records, [r.getMessage() for r in self.errors.records]
        value = os.urandom(8)
        self.good.set("good/probe", value, time.monotonic() + IO_DEADLINE)
        assert self.good.get("good/probe", time.monotonic() + IO_DEADLINE) == value


@pytest.fixture(scope="module")
def harness() -> Iterator[_Harness]:
    logger = logging.getLogger("bitcoll.store")
    errors = _Errors()
    logger.addHandler(errors)
    escaped: list[BaseException] = []
    old_hook = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        if args.exc_value is not None:
            escaped.append(args.exc_value)
        old_hook(args)

    threading.excepthook = hook
    server = StoreServer("127.0.0.1", 0, secret=SECRET, auth_seconds=IO_DEADLINE,
                         io_seconds=IO_DEADLINE)
    good = StoreClient.connect("127.0.0.1", server.port, time.monotonic() + IO_DEADLINE,
                               secret=SECRET)
    try:
        yield _Harness(server, good, errors, escaped)
    finally:
        good.close()
        server.close()
        threading.excepthook = old_hook
        logger.removeHandler(errors)


def _recv_exact(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("EOF")
        buf += chunk
    return buf


def _send_then_drain(s: socket.socket, data: bytes) -> bytes:
    """Send ``data`` (the server may drop us meanwhile), half-close, and return everything the
    server sends until it closes the connection; fail at the deadline."""
    try:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
    except OSError:  # EPIPE, ECONNRESET, ENOTCONN: dropped while sending
        pass
    got = b""
    try:
        while chunk := s.recv(65536):
            got += chunk
    except ConnectionResetError:
        pass
    except TimeoutError:
        pytest.fail(f"the server neither answered nor closed within {IO_DEADLINE} s")
    return got


def _measured(h: _Harness, example: bytes, authed: bool) -> bytes:
    """Run one example on a new connection; return what the server sent after the handshake
    (before it: everything, greeting included) and check the allocation bound (traced from
    the connection's start to its end, the server thread's allocations included)."""
    ours = not tracemalloc.is_tracing()  # (unless the whole run traces: python -X tracemalloc)
    if ours:
        tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        with socket.create_connection(("127.0.0.1", h.server.port),
                                      timeout=IO_DEADLINE) as s:
            if authed:
                magic, _, hint_len, gen, snonce = GREETING.unpack(
                    _recv_exact(s, GREETING.size))
                assert magic == b"BCS1"
                _recv_exact(s, hint_len)
                cnonce = auth.new_nonce()
                s.sendall(cnonce)  # the server proves itself first
                assert auth.verify(SECRET, _recv_exact(s, 32), "store-server", snonce, cnonce,
                                   gen)
                s.sendall(auth.mac(SECRET, "store-client", snonce, cnonce, gen))
                assert _recv_exact(s, 1) == b"\x00"
            got = _send_then_drain(s, example)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        if ours:
            tracemalloc.stop()
    assert peak - before < ALLOC_BOUND, f"{peak - before} bytes allocated for one example"
    return got


# -- strategies --------------------------------------------------------------------------------

_u16 = st.integers(0, 0xFFFF).map(lambda n: struct.pack("<H", n))
_u32 = st.one_of(st.sampled_from([0, 1, 50, 0xFFFFFFFF]), st.integers(0, 0xFFFFFFFF)).map(
    lambda n: struct.pack("<I", n))
_i64 = st.integers(-(1 << 63), (1 << 63) - 1).map(lambda n: struct.pack("<q", n))
_key_bytes = st.one_of(st.text(max_size=12).map(lambda t: ("fuzz/" + t).encode()),
                       st.binary(max_size=12))
_key = st.one_of(_key_bytes.map(lambda k: struct.pack("<H", len(k)) + k),  # well-formed
                 st.tuples(_u16, _key_bytes).map(lambda t: t[0] + t[1]))  # lying length
_keys = st.lists(_key, max_size=4).map(lambda ks: struct.pack("<H", len(ks)) + b"".join(ks))
_field = st.one_of(_key, _keys, _u32, _i64, _u16, st.binary(max_size=16))
_loose_body = st.tuples(st.integers(0, 8).map(lambda op: bytes([op])),
                        st.lists(_field, max_size=4)).map(lambda t: t[0] + b"".join(t[1]))
# Well-formed requests on a few shared keys (so that SETs, ADDs, GETs and WAITs meet).
_vkey = st.one_of(st.sampled_from(["fuzz/a", "fuzz/b", "fuzz/n"]), st.text(max_size=8)).map(
    lambda k: k.encode())


def _enc(k: bytes) -> bytes:
    return struct.pack("<H", len(k)) + k


_timeout = st.sampled_from([0, 1, 20, 0xFFFFFFFF]).map(lambda n: struct.pack("<I", n))
_valid_body = st.one_of(
    st.tuples(_vkey, st.binary(max_size=64)).map(lambda t: b"\x01" + _enc(t[0]) + t[1]),
    st.tuples(_timeout, _vkey).map(lambda t: b"\x02" + t[0] + _enc(t[1])),
    st.tuples(st.one_of(_i64, st.integers(-5, 5).map(lambda n: struct.pack("<q", n))),
              _vkey).map(lambda t: b"\x03" + t[0] + _enc(t[1])),
    st.tuples(_timeout, st.lists(_vkey, max_size=3)).map(
        lambda t: b"\x04" + t[0] + struct.pack("<H", len(t[1])) + b"".join(map(_enc, t[1]))),
    st.lists(_vkey, max_size=3).map(
        lambda ks: b"\x05" + struct.pack("<H", len(ks)) + b"".join(map(_enc, ks))),
)
_body = st.one_of(_valid_body, _loose_body)
_message = st.one_of(
    _body.map(lambda b: struct.pack("<I", len(b)) + b),  # a true length prefix
    st.tuples(_u32, _body).map(lambda t: t[0] + t[1]),  # any length prefix
)
_requests = st.one_of(
    st.lists(_message, min_size=1, max_size=5).map(b"".join),
    st.binary(max_size=4096),
    st.tuples(st.lists(_message, max_size=3).map(b"".join), st.binary(max_size=64)).map(
        lambda t: t[0] + t[1]),
)
_before_auth = st.one_of(
    st.binary(max_size=200),
    st.binary(min_size=48, max_size=48),
    st.binary(min_size=49, max_size=4096),
    _requests,
)


def _check_replies(data: bytes) -> list[int]:
    """``data`` is a sequence of well-formed replies; return their statuses."""
    pos = 0
    statuses = []
    while pos < len(data):
        assert pos + 4 <= len(data), f"a truncated reply header: {data[pos:]!r}"
        (n,) = struct.unpack_from("<I", data, pos)
        assert 1 <= n <= store.MAX_BODY
        assert pos + 4 + n <= len(data), "a truncated reply"
        assert data[pos + 4] in (0, 1, 2), f"reply status {data[pos + 4]}"
        statuses.append(data[pos + 4])
        pos += 4 + n
    return statuses


@FUZZ_SETTINGS
@given(example=_before_auth)
def test_any_bytes_before_the_handshake_are_dropped(harness: _Harness, example: bytes) -> None:
    got = _measured(harness, example, authed=False)
    # The greeting, perhaps the server's proof (it proves itself first, once 16 bytes of
    # client nonce are in) and the rejection byte, then the end: never a reply to a request.
    if got:
        assert got[:4] == b"BCS1"
        rest = got[GREETING.size:]
        assert rest in (b"", got[GREETING.size:GREETING.size + 32],
                        got[GREETING.size:GREETING.size + 32] + b"\x01"), rest
        assert len(rest) in (0, 32, 33), rest
    assert harness.server.num_clients == 1  # only the good client
    harness.check()


@FUZZ_SETTINGS
@given(example=_requests)
def test_any_requests_after_the_handshake_get_replies_or_a_drop(harness: _Harness,
                                                                example: bytes) -> None:
    got = _measured(harness, example, authed=True)
    statuses = _check_replies(got)
    event(f"replies: {sorted(set(statuses))}")
    harness.check()
