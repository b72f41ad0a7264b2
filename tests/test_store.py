"""The rendezvous store: one server, clients in threads of this process."""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Iterator

import pytest

from bitcoll.errors import CommError, CommTimeoutError, PeerLostError, UsageError
from bitcoll.transport.store import StoreClient, StoreServer

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def server() -> Iterator[StoreServer]:
    srv = StoreServer("127.0.0.1", 0)
    yield srv
    srv.close()


def _client(server: StoreServer) -> StoreClient:
    return StoreClient.connect("127.0.0.1", server.port, time.monotonic() + 5)


def _later(delay: float, fn: object, *args: object) -> threading.Thread:
    def run() -> None:
        time.sleep(delay)
        fn(*args)  # type: ignore[operator]

    th = threading.Thread(target=run)
    th.start()
    return th


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
        th = _later(0.3, a.set, "late", b"here")
        t0 = time.monotonic()
        assert b.get("late", t0 + 10) == b"here"
        assert 0.25 <= time.monotonic() - t0 < 5
        th.join()


def test_get_times_out_at_the_deadline(server: StoreServer) -> None:
    with _client(server) as c:
        t0 = time.monotonic()
        with pytest.raises(CommTimeoutError, match="never"):
            c.get("never", t0 + 0.3)
        assert 0.3 <= time.monotonic() - t0 < 1.5
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
        with pytest.raises(UsageError, match="decimal integer"):
            c.add("text", 1)
        assert c.add("other", 2) == 2  # the connection survives the error


def test_wait_for_several_keys(server: StoreServer) -> None:
    with _client(server) as a, _client(server) as b:
        a.set("k0", b"")
        ths = [_later(0.1 * i, a.set, f"k{i}", b"x") for i in (1, 2, 3)]
        t0 = time.monotonic()
        b.wait([f"k{i}" for i in range(4)], t0 + 10)
        assert time.monotonic() - t0 >= 0.25
        for th in ths:
            th.join()
        assert b.missing(["k1", "nope", "k3", "nada"]) == ["nope", "nada"]
        t0 = time.monotonic()
        with pytest.raises(CommTimeoutError, match="nope"):
            b.wait(["k1", "nope"], t0 + 0.2)
        assert 0.2 <= time.monotonic() - t0 < 1.5


def test_bad_keys_are_usage_errors(server: StoreServer) -> None:
    with _client(server) as c:
        with pytest.raises(UsageError):
            c.set("x" * 70000, b"")
        with pytest.raises(UsageError):
            c.set(b"bytes-key", b"")  # type: ignore[arg-type]


def test_connect_retries_until_the_server_starts() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    box: dict[str, StoreServer] = {}
    th = _later(0.3, lambda: box.setdefault("srv", StoreServer("127.0.0.1", port)))
    t0 = time.monotonic()
    c = StoreClient.connect("127.0.0.1", port, t0 + 10)
    assert time.monotonic() - t0 >= 0.25
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
        StoreClient.connect("127.0.0.1", port, t0 + 0.5)
    assert 0.5 <= time.monotonic() - t0 < 2


def test_server_close_fails_a_blocked_client_promptly(server: StoreServer) -> None:
    c = _client(server)
    c.set("x", b"")  # a round trip: the server has accepted the connection
    assert server.num_clients == 1
    th = _later(0.2, server.close)
    t0 = time.monotonic()
    with pytest.raises(PeerLostError):
        c.get("never", t0 + 20)
    assert time.monotonic() - t0 < 3
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


def test_binding_a_port_in_use_is_a_comm_error(server: StoreServer) -> None:
    with pytest.raises(CommError, match="cannot serve"):
        StoreServer("127.0.0.1", server.port)


def test_malformed_request_gets_an_error_reply(server: StoreServer) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
        s.sendall(struct.pack("<I", 1) + b"\x63")  # unknown opcode 99
        n = struct.unpack("<I", s.recv(4, socket.MSG_WAITALL))[0]
        body = s.recv(n, socket.MSG_WAITALL)
        assert body[0] == 2 and b"unknown opcode" in body
