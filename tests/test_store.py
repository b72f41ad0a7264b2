"""The rendezvous store: one server, clients in threads of this process (and, for the tests that
measure the server's process, a server in a process of its own: tests/scripts/store_server.py).

Everything runs on 127.0.0.1. Interleavings are set up with events and explicit waits on
conditions; the few ``_later`` sleeps only check that blocking calls do block.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import select
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from errcheck import raises_usage

from bitcoll.errors import CommError, CommTimeoutError, PeerLostError, UsageError
from bitcoll.transport.rendezvous import auth, store
from bitcoll.transport.rendezvous.store import StoreClient, StoreServer

pytestmark = pytest.mark.timeout(60)

SECRET = b"the job's secret for the store tests"
SCRIPT = Path(__file__).parent / "scripts" / "store_server.py"
GREETING = struct.Struct("<4sHHQ16s")


@pytest.fixture
def server() -> Iterator[StoreServer]:
    srv = StoreServer("127.0.0.1", 0, secret=SECRET)
    yield srv
    srv.close()


def _client(server: StoreServer | int, secret: bytes | None = SECRET, deadline: float = 5.0,
            generation: int = 0) -> StoreClient:
    port = server if isinstance(server, int) else server.port
    return StoreClient.connect("127.0.0.1", port, time.monotonic() + deadline, secret=secret,
                               generation=generation)


def _later(delay: float, fn: object, *args: object) -> threading.Thread:
    def run() -> None:
        time.sleep(delay)
        fn(*args)  # type: ignore[operator]

    th = threading.Thread(target=run)
    th.start()
    return th


# -- raw protocol helpers (an independent implementation of the client's side) ------------------


def _recv_exact(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise ConnectionError(f"EOF after {len(buf)} of {n} bytes")
        buf += chunk
    return buf


def _greeting(s: socket.socket) -> tuple[int, int, bytes, str]:
    """Read the server's greeting: (version, generation, nonce, hint)."""
    magic, version, hint_len, gen, nonce = GREETING.unpack(_recv_exact(s, GREETING.size))
    assert magic == b"BCS1"
    return version, gen, nonce, _recv_exact(s, hint_len).decode()


def _raw_auth(port: int, secret: bytes = SECRET, timeout: float = 10.0) -> socket.socket:
    """A raw connection that completed the handshake (and checked the server's proof)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    _, gen, snonce, _ = _greeting(s)
    cnonce = os.urandom(16)
    s.sendall(cnonce)  # the server proves itself first
    assert auth.verify(secret, _recv_exact(s, 32), "store-server", snonce, cnonce, gen)
    s.sendall(auth.mac(secret, "store-client", snonce, cnonce, gen))
    status = _recv_exact(s, 1)
    assert status == b"\x00"
    return s


def _raw_request(s: socket.socket, body: bytes) -> bytes:
    s.sendall(struct.pack("<I", len(body)) + body)
    (n,) = struct.unpack("<I", _recv_exact(s, 4))
    return _recv_exact(s, n)


def _msg(body: bytes) -> bytes:
    return struct.pack("<I", len(body)) + body


def _key(k: str) -> bytes:
    raw = k.encode()
    return struct.pack("<H", len(raw)) + raw


def _closed_by_peer(s: socket.socket, timeout: float) -> bytes:
    """Read until the server closes the connection (EOF or reset) and return what came; fail
    if it stays open ``timeout`` seconds."""
    s.settimeout(timeout)
    got = b""
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return got
            got += chunk
    except ConnectionResetError:
        return got
    except TimeoutError:
        pytest.fail(f"the server kept the connection open for {timeout} s")


def _works(server: StoreServer | int, key: str = "probe") -> None:
    """A good client connects, writes and reads."""
    with _client(server) as c:
        value = os.urandom(8)
        c.set(key, value)
        assert c.get(key, time.monotonic() + 5) == value


class _Flag(logging.Handler):
    """Sets an event when a record of the store's logger contains ``text``."""

    def __init__(self, text: str) -> None:
        super().__init__(logging.DEBUG)
        self.text = text
        self.event = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.event.set()


@pytest.fixture
def store_log() -> Iterator[Callable[[str], threading.Event]]:
    """``flag(text)``: an event set once the store logs a message containing ``text``."""
    logger = logging.getLogger("bitcoll.store")
    level = logger.level
    logger.setLevel(logging.DEBUG)
    handlers: list[_Flag] = []

    def flag(text: str) -> threading.Event:
        h = _Flag(text)
        logger.addHandler(h)
        handlers.append(h)
        return h.event

    yield flag
    for h in handlers:
        logger.removeHandler(h)
    logger.setLevel(level)


# -- operations (the tests of the unauthenticated store, with a secret) -------------------------


def test_set_get_try_get_and_binary_values(server: StoreServer) -> None:
    with _client(server) as a, _client(server) as b:
        blob = bytes(range(256)) * 4096  # 1 MiB with every byte value
        a.set("blob", blob)
        a.set("empty", b"")
        a.set("ключ/ü", b"\x00\xff")
        assert b.get("blob", time.monotonic() + 5) == blob
        assert b.get("empty", time.monotonic() + 5) == b""
        assert b.get("ключ/ü", time.monotonic() + 5) == b"\x00\xff"
        assert b.try_get("absent") is None
        a.set("blob", b"new")  # replaces
        assert b.try_get("blob") == b"new"


def test_get_blocks_until_another_client_sets(server: StoreServer) -> None:
    with _client(server) as a, _client(server) as b:
        t0 = time.monotonic()
        th = _later(0.3, a.set, "late", b"here")
        assert b.get("late", t0 + 10) == b"here"
        assert time.monotonic() - t0 >= 0.3  # it waited for the set
        th.join()


def test_get_times_out_at_the_deadline(server: StoreServer) -> None:
    with _client(server) as c:
        t0 = time.monotonic()
        with pytest.raises(CommTimeoutError, match="never"):
            c.get("never", t0 + 0.3)
        assert time.monotonic() - t0 >= 0.3  # not before the deadline
        c.set("after", b"1")  # the client is still usable after a server-side time-out
        assert c.get("after", time.monotonic() + 1) == b"1"


def test_add_is_atomic_across_concurrent_clients(server: StoreServer) -> None:
    clients = [_client(server) for _ in range(8)]
    results: list[list[int]] = [[] for _ in clients]

    def work(i: int) -> None:
        for _ in range(100):
            results[i].append(clients[i].add("counter", 1))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(clients))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    every = sorted(v for r in results for v in r)
    assert every == list(range(1, 801))  # each increment saw a distinct value
    assert clients[0].get("counter") == b"800"
    assert clients[1].add("counter", -800) == 0
    assert clients[2].add("fresh", 5) == 5
    for c in clients:
        c.close()


def test_add_on_a_non_integer_is_a_usage_error(server: StoreServer) -> None:
    with _client(server) as c:
        c.set("text", b"hello")
        # (the server's refusals reach the client as text only: no argument to check)
        with pytest.raises(UsageError, match="decimal integer"):
            c.add("text", 1)
        assert c.add("other", 2) == 2  # the connection survives the error
        c.set("big", str((1 << 63) - 1).encode())
        with pytest.raises(UsageError, match="overflows"):
            c.add("big", 1)


def test_wait_for_several_keys(server: StoreServer) -> None:
    with _client(server) as a, _client(server) as b:
        a.set("k0", b"")
        t0 = time.monotonic()
        ths = [_later(0.1 * i, a.set, f"k{i}", b"x") for i in (1, 2, 3)]
        b.wait([f"k{i}" for i in range(4)], t0 + 10)
        assert time.monotonic() - t0 >= 0.3  # it waited for the last of them
        for th in ths:
            th.join()
        assert b.missing(["k1", "nope", "k3", "nada"]) == ["nope", "nada"]
        t0 = time.monotonic()
        with pytest.raises(CommTimeoutError, match="nope"):
            b.wait(["k1", "nope"], t0 + 0.2)
        assert time.monotonic() - t0 >= 0.2


def test_one_set_answers_every_parked_request(server: StoreServer) -> None:
    clients = [_client(server) for _ in range(6)]
    got: list[bytes | None] = [None] * 6
    parked = [_raw_auth(server.port) for _ in range(2)]
    # Two raw requests that the server must park (so the SET below is needed to answer them).
    parked[0].sendall(_msg(b"\x02" + struct.pack("<I", 20000) + _key("go")))
    parked[1].sendall(_msg(b"\x04" + struct.pack("<IH", 20000, 2) + _key("go") + _key("k0")))

    def getter(i: int) -> None:
        got[i] = clients[i].get("go", time.monotonic() + 20)

    ths = [threading.Thread(target=getter, args=(i,)) for i in range(5)]
    for th in ths:
        th.start()
    clients[5].set("k0", b"")
    assert clients[5].missing(["go", "k0"]) == ["go"]  # nothing answered the parked ones yet
    clients[5].set("go", b"now")
    for th in ths:
        th.join(20)
    assert got[:5] == [b"now"] * 5
    parked[0].settimeout(5)
    parked[1].settimeout(5)
    assert struct.unpack("<I", _recv_exact(parked[0], 4))[0] == 4
    assert _recv_exact(parked[0], 4) == b"\x00now"
    assert _recv_exact(parked[1], 5) == struct.pack("<I", 1) + b"\x00"
    for s in parked:
        s.close()
    for c in clients:
        c.close()


def test_pipelined_requests_are_answered_in_order(server: StoreServer) -> None:
    s = _raw_auth(server.port)
    msgs = [b"\x01" + _key("p") + b"v1",
            b"\x02" + struct.pack("<I", 0) + _key("p"),
            b"\x03" + struct.pack("<q", 3) + _key("n"),
            b"\x05" + struct.pack("<H", 2) + _key("p") + _key("q")]
    s.sendall(b"".join(struct.pack("<I", len(m)) + m for m in msgs))
    replies = []
    for _ in msgs:
        (n,) = struct.unpack("<I", _recv_exact(s, 4))
        replies.append(_recv_exact(s, n))
    assert replies == [b"\x00", b"\x00v1", b"\x00" + struct.pack("<q", 3),
                       b"\x00" + struct.pack("<H", 1) + _key("q")]
    s.close()


def test_bad_keys_are_usage_errors(server: StoreServer) -> None:
    with _client(server) as c:
        with pytest.raises(UsageError):
            c.set("x" * 70000, b"")
        with pytest.raises(UsageError):
            c.set(b"bytes-key", b"")  # type: ignore[arg-type]
        c.set("x" * 65535, b"longest key")
        assert c.get("x" * 65535) == b"longest key"


def test_connect_retries_until_the_server_starts() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    box: dict[str, StoreServer] = {}
    t0 = time.monotonic()
    th = _later(0.3, lambda: box.setdefault("srv", StoreServer("127.0.0.1", port,
                                                                 secret=SECRET)))
    c = StoreClient.connect("127.0.0.1", port, t0 + 10, secret=SECRET)
    assert time.monotonic() - t0 >= 0.3  # it kept trying until the server started
    c.set("a", b"b")
    c.close()
    th.join()
    box["srv"].close()


def test_connect_times_out_when_nobody_serves() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(CommTimeoutError, match="no rendezvous store"):
        StoreClient.connect("127.0.0.1", port, t0 + 0.5, secret=SECRET)
    assert time.monotonic() - t0 >= 0.5


def test_server_close_fails_a_blocked_client_promptly(server: StoreServer) -> None:
    c = _client(server)
    c.set("x", b"")  # a round trip: the server has accepted the connection
    assert server.num_clients == 1
    th = _later(0.2, server.close)
    with pytest.raises(PeerLostError):  # at the close, not the CommTimeoutError at 20 s
        c.get("never", time.monotonic() + 20)
    with pytest.raises(PeerLostError):  # broken for good
        c.set("x", b"")
    th.join()
    c.close()
    server.close()  # idempotent


def test_wait_idle_tracks_connected_clients(server: StoreServer) -> None:
    a, b = _client(server), _client(server)
    a.set("x", b"1")
    assert not server.wait_idle(time.monotonic() + 0.1)
    a.close()
    _later(0.2, b.close)
    t0 = time.monotonic()
    assert server.wait_idle(t0 + 5)
    assert server.num_clients == 0


def test_a_client_leaving_while_parked_frees_its_slot(server: StoreServer) -> None:
    s = _raw_auth(server.port)
    s.sendall(_msg(b"\x02" + struct.pack("<I", 0xFFFFFFFF) + _key("never")))  # for 49 days
    assert server.num_clients == 1
    s.close()
    assert server.wait_idle(time.monotonic() + 5)
    _works(server)


def test_strangers_never_count_as_clients(server: StoreServer) -> None:
    strangers = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(5)]
    for s in strangers:
        s.settimeout(5)
        _greeting(s)  # the server has accepted it
    assert server.num_clients == 0
    assert server.wait_idle(time.monotonic() + 0.01)
    with _client(server) as c:
        c.set("x", b"")
        assert server.num_clients == 1
    for s in strangers:
        s.close()


def test_binding_a_port_in_use_is_a_comm_error(server: StoreServer) -> None:
    with pytest.raises(CommError, match="cannot serve"):
        StoreServer("127.0.0.1", server.port, secret=SECRET)


def test_malformed_request_gets_an_error_reply(server: StoreServer) -> None:
    with _raw_auth(server.port) as s:
        body = _raw_request(s, b"\x63")  # unknown opcode 99
        assert body[0] == 2 and b"unknown opcode" in body
        body = _raw_request(s, b"\x02\x00")  # truncated GET
        assert body[0] == 2 and b"truncated" in body
        body = _raw_request(s, b"\x05" + struct.pack("<H", 1) + _key("k") + b"junk")
        assert body[0] == 2 and b"trailing" in body
        body = _raw_request(s, b"\x01" + struct.pack("<H", 2) + b"\xff\xfe")
        assert body[0] == 2 and b"UTF-8" in body
        assert _raw_request(s, b"\x01" + _key("ok") + b"v") == b"\x00"  # still usable


def test_bad_arguments_are_usage_errors() -> None:
    with pytest.raises(UsageError):
        StoreServer("127.0.0.1", 0, secret="text")  # type: ignore[arg-type]
    with pytest.raises(UsageError):
        StoreServer("127.0.0.1", 0, secret=SECRET, generation=-1)
    with pytest.raises(UsageError):
        StoreServer("127.0.0.1", 0, secret=SECRET, hint="x" * 5000)
    with pytest.raises(UsageError):
        StoreClient.connect("127.0.0.1", 1, time.monotonic() + 1, secret=SECRET,
                            generation=1 << 64)


# -- authentication ----------------------------------------------------------------------------


def test_greeting_announces_version_generation_and_hint() -> None:
    with StoreServer("127.0.0.1", 0, secret=SECRET, generation=7, hint="/some/path") as srv, \
            socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s:
        version, gen, nonce, hint = _greeting(s)
        assert (version, gen, hint, len(nonce)) == (2, 7, "/some/path", 16)
        with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s2:
            assert _greeting(s2)[2] != nonce  # a fresh nonce per connection
        assert srv.generation == 7


def test_wrong_secret_on_the_client_is_refused_and_the_store_keeps_serving(
        server: StoreServer, store_log: Callable[[str], threading.Event]) -> None:
    # The store proves itself first: the client cannot verify that proof and hangs up.
    logged = store_log("closed the connection during the handshake")
    with pytest.raises(CommTimeoutError, match="could not prove it knows the job's secret"):
        _client(server, secret=b"not the secret", deadline=0.5)
    assert logged.wait(5)
    assert server.num_clients == 0
    _works(server)


def test_a_server_with_the_wrong_secret_is_refused() -> None:
    with StoreServer("127.0.0.1", 0, secret=b"another job's secret") as other, \
            pytest.raises(CommTimeoutError, match="prove"):
        _client(other, deadline=0.5)


def test_a_squatter_that_cannot_prove_the_secret_is_refused() -> None:
    """A stranger on the store's port that cannot prove the secret: the client must not
    believe it and must send it nothing after its nonce (no proof of its own, which the
    stranger could test guesses of the secret against)."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    after_proof: list[bytes] = []

    def squat() -> None:
        listener.settimeout(10)
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(5)
                conn.sendall(GREETING.pack(b"BCS1", 2, 0, 0, os.urandom(16)))
                try:
                    _recv_exact(conn, 16)
                    conn.sendall(os.urandom(32))
                    after_proof.append(_closed_by_peer(conn, 5))
                except OSError:
                    pass

    th = threading.Thread(target=squat)
    th.start()
    with pytest.raises(CommTimeoutError, match="could not prove it knows the job's secret"):
        _client(port, deadline=0.5)
    listener.shutdown(socket.SHUT_RDWR)  # wakes accept()
    listener.close()
    th.join(10)
    assert after_proof and all(b == b"" for b in after_proof)


def test_a_stranger_sending_requests_without_the_handshake_is_dropped(
        server: StoreServer) -> None:
    with _client(server) as good:
        good.set("victim", b"kept")
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
            _greeting(s)
            body = b"\x01" + _key("victim") + b"overwritten by a stranger" + b"!" * 40
            s.sendall(struct.pack("<I", len(body)) + body)
            # (the store's own proof, which comes first, then the refusal)
            assert _closed_by_peer(s, 5)[32:] in (b"", b"\x01")
        assert good.get("victim") == b"kept"
        assert server.num_clients == 1


class _Recorder:
    """A relay between one client and the store that records the bytes the client sends."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.sent = bytearray()
        self.thread = threading.Thread(target=self._run)
        self.thread.start()

    def _run(self) -> None:
        self.listener.settimeout(10)
        client, _ = self.listener.accept()
        upstream = socket.create_connection(("127.0.0.1", self.target), timeout=10)
        back = threading.Thread(target=self._pump, args=(upstream, client, False))
        back.start()
        self._pump(client, upstream, True)
        back.join(10)
        client.close()
        upstream.close()

    def _pump(self, src: socket.socket, dst: socket.socket, record: bool) -> None:
        try:
            while data := src.recv(65536):
                if record:
                    self.sent += data
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass


def test_a_replayed_handshake_is_refused(server: StoreServer) -> None:
    relay = _Recorder(server.port)
    with _client(relay.port) as c:
        c.set("victim", b"replayed")
    relay.thread.join(10)
    captured = bytes(relay.sent)
    assert len(captured) > 48  # the proof, then the SET request
    with _client(server) as good:
        good.set("victim", b"current")
        for _ in range(3):
            with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
                _greeting(s)  # another server nonce: the captured proof does not match it
                s.sendall(captured)
                # (the store's own proof, which comes first, then the refusal)
                assert _closed_by_peer(s, 5)[32:] in (b"", b"\x01")
        assert good.get("victim") == b"current"
        assert server.num_clients == 1


def test_secret_read_from_the_hint() -> None:
    sf = auth.SecretFile()
    try:
        with StoreServer("127.0.0.1", 0, secret=sf.secret, hint=sf.path) as srv:
            with _client(srv, secret=None) as c:
                assert c.secret == sf.secret
                c.set("k", b"v")
                assert c.get("k") == b"v"
            with _client(srv, secret=sf.secret) as c:
                assert c.secret == sf.secret
    finally:
        sf.remove()


def test_a_hint_to_a_missing_file_is_a_usage_error_at_once() -> None:
    missing = "/nonexistent/bitcoll-test/secret"
    with StoreServer("127.0.0.1", 0, secret=SECRET, hint=missing) as srv:
        t0 = time.monotonic()
        with raises_usage("BITCOLL_SECRET"):  # (the hinted file is missing)
            _client(srv, secret=None, deadline=30)
        assert time.monotonic() - t0 < 30  # at once, not at the end of the retries
    with StoreServer("127.0.0.1", 0, secret=SECRET) as srv, \
            raises_usage("BITCOLL_SECRET"):  # (no file is hinted)
        _client(srv, secret=None, deadline=30)


def test_a_hint_to_a_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    """A stranger's greeting may name any path: opening a FIFO must not hang the client."""
    fifo = tmp_path / "secret"
    os.mkfifo(fifo, 0o600)
    with StoreServer("127.0.0.1", 0, secret=SECRET, hint=str(fifo)) as srv:
        t0 = time.monotonic()
        with pytest.raises(UsageError, match="not a private file"):
            _client(srv, secret=None, deadline=30)
        assert time.monotonic() - t0 < 30  # at once, not at the end of the retries


def test_a_stale_generation_is_retried_until_its_successor_serves(
        store_log: Callable[[str], threading.Event]) -> None:
    old = StoreServer("127.0.0.1", 0, secret=SECRET, generation=0)
    port = old.port
    saw_stale = store_log("earlier communicator")
    box: dict[str, object] = {}

    def connect() -> None:
        try:
            box["client"] = _client(port, deadline=30, generation=1)
        except BaseException as exc:
            box["error"] = exc

    th = threading.Thread(target=connect)
    th.start()
    try:
        assert saw_stale.wait(20), "the client never met the stale store"
        assert "client" not in box
        old.close()
        new = StoreServer("127.0.0.1", port, secret=SECRET, generation=1)
        th.join(30)
        assert "error" not in box, box.get("error")
        c = box["client"]
        assert isinstance(c, StoreClient)
        c.set("k", b"gen1")
        assert c.get("k") == b"gen1"
        assert new.num_clients == 1
        c.close()
        new.close()
    finally:
        old.close()
        th.join(30)


def test_a_later_generation_is_a_usage_error_at_once() -> None:
    with StoreServer("127.0.0.1", 0, secret=SECRET, generation=2) as srv:
        t0 = time.monotonic()
        with raises_usage("generation"):  # (the store's is later)
            _client(srv, deadline=30, generation=1)
        assert time.monotonic() - t0 < 30  # at once, not at the end of the retries
        _client(srv, generation=2).close()


# -- limits ------------------------------------------------------------------------------------


def test_oversized_values_and_messages(server: StoreServer) -> None:
    with _client(server) as c:
        with raises_usage("value"):
            c.set("big", b"x" * (store.MAX_VALUE + 1))
        with raises_usage("keys"):
            c.wait(["k" * 60000] * 30)  # a request body over MAX_BODY
        c.set("max", b"y" * store.MAX_VALUE)
    with _raw_auth(server.port) as s:
        # A body within MAX_BODY whose value is over MAX_VALUE: an error reply, still usable.
        body = b"\x01" + _key("big") + b"z" * (store.MAX_BODY - 6)
        reply = _raw_request(s, body)
        assert reply[0] == 2 and b"larger than the limit" in reply
        assert _raw_request(s, b"\x02" + struct.pack("<I", 0) + _key("big")) == b"\x01"
        # A length prefix over MAX_BODY: the connection is dropped at once.
        s.sendall(struct.pack("<I", store.MAX_BODY + 1) + b"\x01")
        assert _closed_by_peer(s, 5) == b""
    _works(server)


def test_key_and_byte_caps_give_errors() -> None:
    assert (store.MAX_KEYS, store.MAX_STORED_BYTES) == (65536, 64 << 20)
    with StoreServer("127.0.0.1", 0, secret=SECRET, max_keys=10, max_stored_bytes=4096) as srv, \
            _client(srv) as c:
        for i in range(10):
            c.set(f"k{i}", b"v")
        # (the server's refusals reach the client as text only: no argument to check)
        with pytest.raises(UsageError, match="full"):
            c.set("k10", b"v")
        with pytest.raises(UsageError, match="full"):
            c.add("counter", 1)
        c.set("k0", b"replaced")  # replacing stays within the caps
        with pytest.raises(UsageError, match="decimal integer"):
            c.add("k1", 1)  # k1 holds b"v", not a counter
        c.set("k1", b"5")
        assert c.add("k1", 10) == 15
        with pytest.raises(UsageError, match="full"):
            c.set("k2", b"x" * 4096)  # over the byte cap
        assert c.get("k2") == b"v"
        c.set("k2", b"x" * 3000)
        with pytest.raises(UsageError, match="full"):
            c.set("k3", b"x" * 1500)
        assert c.missing(["k9", "k10"]) == ["k10"]


def test_slowloris_connections_are_dropped_at_their_deadlines() -> None:
    with StoreServer("127.0.0.1", 0, secret=SECRET, auth_seconds=0.5, io_seconds=0.5) as srv:
        strangers = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(20)]
        for s in strangers:
            s.sendall(b"\x00")  # one byte of a proof, then nothing
        slow = [_raw_auth(srv.port) for _ in range(5)]
        for i, s in enumerate(slow):  # a part of a header, or a header and part of a body
            s.sendall(b"\x10" if i % 2 else struct.pack("<I", 100) + b"\x01\x01")
        assert srv.num_clients == 5
        with _client(srv) as good:  # served meanwhile
            for s in strangers:
                got = _closed_by_peer(s, 10)
                assert got.startswith(b"BCS1")
            for s in slow:
                assert _closed_by_peer(s, 10) == b""
            good.set("still", b"here")
            assert good.get("still") == b"here"
            assert srv.num_clients == 1
        for s in strangers + slow:
            s.close()


def test_a_client_that_never_reads_is_dropped() -> None:
    with StoreServer("127.0.0.1", 0, secret=SECRET, io_seconds=0.5) as srv:
        with _client(srv) as c:
            c.set("big", b"b" * store.MAX_VALUE)
        s = _raw_auth(srv.port)
        # Eight pipelined GETs of 1 MiB that it does not read: the kernel's buffers take the
        # first few replies (up to 4 MiB of send buffer), the next one waits in the server.
        s.sendall(_msg(b"\x02" + struct.pack("<I", 0) + _key("big")) * 8)
        assert srv.num_clients == 1
        assert srv.wait_idle(time.monotonic() + 10)  # dropped
        s.close()
        _works(srv)


def test_beyond_max_pending_auth_the_oldest_stranger_is_evicted(
        store_log: Callable[[str], threading.Event]) -> None:
    evicted = store_log("unauthenticated connections are waiting")
    with StoreServer("127.0.0.1", 0, secret=SECRET, auth_seconds=30,
                     max_pending_auth=4) as srv:
        strangers = [socket.create_connection(("127.0.0.1", srv.port), timeout=10)
                     for _ in range(4)]
        for s in strangers:
            _greeting(s)  # accepted: the four unauthenticated slots are taken
        assert not evicted.is_set()
        _works(srv)  # waits in the backlog until the oldest stranger is 1 s old
        assert evicted.is_set()  # it got in by an eviction (not by a stranger's time-out)
        assert _closed_by_peer(strangers[0], 5) == b""  # evicted
        for s in strangers[1:]:  # the younger ones were not needed
            s.setblocking(False)
            with pytest.raises(BlockingIOError):  # open, nothing to read
                s.recv(1)
            s.close()
        strangers[0].close()


def test_one_thread_and_a_prompt_close_while_strangers_hold_connections() -> None:
    srv = StoreServer("127.0.0.1", 0, secret=SECRET)
    threads_before = threading.active_count()
    held: list[socket.socket] = []
    try:
        for i in range(60):
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
            if i % 3 == 0:
                s.sendall(b"\x07" * 10)  # a part of a proof
            held.append(s)
        held += [_raw_auth(srv.port) for _ in range(20)]
        for s in held[-20:]:
            s.sendall(struct.pack("<I", 1000) + b"\x01")  # a message that never completes
        assert srv.num_clients == 20
        _works(srv)
        assert threading.active_count() == threads_before
        assert [t.name for t in threading.enumerate()].count("bitcoll-store") >= 1
        srv.close()
        assert not srv._thread.is_alive()  # close() joined it
        for s in held[-20:]:
            assert _closed_by_peer(s, 5) == b""
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", srv.port), timeout=2).close()
    finally:
        for s in held:
            s.close()
        srv.close()


# -- a server in a process of its own -----------------------------------------------------------


class _ServerProcess:
    """tests/scripts/store_server.py running in a child process."""

    def __init__(self, *args: str) -> None:
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
        self.proc = subprocess.Popen([sys.executable, str(SCRIPT), SECRET.hex(), *args],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=env)
        line = self.line(60)
        assert line.startswith("PORT "), line
        self.port = int(line.split()[1])

    def line(self, timeout: float) -> str:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        assert ready, f"no line from the server process within {timeout} s"
        return self.proc.stdout.readline().strip()

    def status(self, field: str) -> int:
        """A number from /proc/PID/status (kB for the memory fields)."""
        for row in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if row.startswith(field + ":"):
                return int(row.split()[1])
        raise KeyError(field)

    def python_threads(self) -> list[str]:
        assert self.proc.stdin is not None
        self.proc.stdin.write("threads\n")
        self.proc.stdin.flush()
        line = self.line(10)
        assert line.startswith("THREADS "), line
        return line.split(" ", 1)[1].split(",")

    def ping(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("ping\n")
        self.proc.stdin.flush()
        assert self.line(10) == "PONG"

    def quit(self) -> list[str]:
        """Close the server; return the Python threads left once its close() returned
        (close() waits a few seconds at most for the server's thread: if that thread did not
        stop, it is among them)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write("quit\n")
        self.proc.stdin.flush()
        line = self.line(30)
        assert line.startswith("CLOSED "), line
        assert self.proc.wait(30) == 0
        return line.split()[2].split(",")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@contextlib.contextmanager
def _served(*args: str) -> Iterator[tuple[_ServerProcess, list[socket.socket]]]:
    """A server process (started with ``args``, checked to serve) and a list for the test's
    sockets; at the end the sockets are closed and the process is killed."""
    srv = _ServerProcess(*args)
    held: list[socket.socket] = []
    try:
        _works(srv.port)
        yield srv, held
    finally:
        for s in held:
            s.close()
        srv.kill()


RSS_BOUND_KB = 64 * 1024  # the server's peak RSS may grow at most this much under the attacks


def test_memory_stays_bounded_under_huge_prefixes_and_garbage() -> None:
    with _served() as (srv, held):
        base = srv.status("VmRSS")
        rng = random.Random(1234)

        # 1 GiB length prefixes: from strangers (as a "proof") and after authentication.
        for _ in range(4):
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
            with contextlib.suppress(OSError):  # dropped while sending
                s.sendall(struct.pack("<I", 1 << 30) + rng.randbytes(1 << 20))
            got = _closed_by_peer(s, 10)  # (a reset may discard the greeting)
            assert got == b"" or got.startswith(b"BCS1")
            s.close()
        for _ in range(4):
            s = _raw_auth(srv.port)
            with contextlib.suppress(OSError):
                s.sendall(struct.pack("<I", 1 << 30) + rng.randbytes(64 << 10))
            assert _closed_by_peer(s, 10) == b""
            s.close()

        # 50 connections of 4 KiB of random bytes, before and after authentication.
        for authed in (False, True):
            conns = [_raw_auth(srv.port) if authed
                     else socket.create_connection(("127.0.0.1", srv.port), timeout=10)
                     for _ in range(50)]
            for s in conns:
                with contextlib.suppress(OSError):
                    s.sendall(rng.randbytes(4096))
            held += conns  # some stay open (a random prefix under MAX_BODY waits for more)
        _works(srv.port)

        # 40 authenticated connections announcing MAX_BODY and sending 1 KiB each: the server
        # must not allocate what is announced (that would be 45 MiB).
        before = srv.status("VmRSS")
        for _ in range(40):
            s = _raw_auth(srv.port)
            s.sendall(struct.pack("<I", store.MAX_BODY) + b"\x01" + rng.randbytes(1023))
            held.append(s)
        _works(srv.port)
        grown = srv.status("VmRSS") - before
        assert grown < 16 * 1024, f"40 announced-but-unsent bodies grew the RSS by {grown} kB"

        peak = srv.status("VmHWM")
        print(f"store server RSS: {base} kB at start, peak {peak} kB (+{peak - base} kB)")
        assert peak - base < RSS_BOUND_KB, f"peak RSS grew by {peak - base} kB"
        srv.ping()
        assert srv.quit() == ["MainThread"]  # the server's thread stopped


def test_threads_stay_one_under_300_connections() -> None:
    with _served() as (srv, held):
        threads = srv.status("Threads")
        for i in range(300):  # 240 clients and 60 strangers
            s = _raw_auth(srv.port) if i % 5 \
                else socket.create_connection(("127.0.0.1", srv.port), timeout=10)
            held.append(s)
        _works(srv.port)
        assert srv.status("Threads") == threads  # no thread per connection
        assert srv.python_threads() == ["MainThread", "bitcoll-store"]
        assert srv.quit() == ["MainThread"]  # while strangers and clients hold connections


def test_the_accept_loop_survives_running_out_of_descriptors() -> None:
    with _served("--nofile", "40", "--auth-seconds", "30") as (srv, held):
        for _ in range(60):  # more than the server has descriptors for
            held.append(socket.create_connection(("127.0.0.1", srv.port), timeout=10))
        line = srv.line(20)
        assert line.startswith("ACCEPT-FAILED") and "Too many open files" in line, line
        for s in held:
            s.close()
        held.clear()
        _works(srv.port)  # served afterwards
        srv.ping()
        assert srv.quit() == ["MainThread"]  # the server's thread stopped
