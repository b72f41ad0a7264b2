"""The authenticated peer hello: strangers, replays and relays never join a job."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bitcoll.errors import ProtocolError
from bitcoll.transport.rendezvous import auth, handshake
from bitcoll.transport.rendezvous.tcp_bootstrap import _Mesh

SECRET = b"s" * 32
JOB = 0x1234


def _listener() -> tuple[socket.socket, str]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(64)
    return s, f"{s.getsockname()[1]} 127.0.0.1"


def _run_mesh(mesh: _Mesh, listener: socket.socket, addrs: dict[int, str],
              box: dict[str, Any]) -> threading.Thread:
    def target() -> None:
        try:
            box["socks"] = mesh.connect(listener, addrs)
        except BaseException as exc:
            box["error"] = exc

    t = threading.Thread(target=target, daemon=True)
    t.start()
    return t


def _pair(secret_a: bytes = SECRET, secret_b: bytes = SECRET,
          strangers: list[bytes] | None = None, timeout: float = 20.0
          ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Rank 1 listens; ``strangers`` connect to it and send their bytes first (each stranger's
    connection is held open until the end); then rank 0 connects."""
    deadline = time.monotonic() + timeout
    l1, addr1 = _listener()
    l0, addr0 = _listener()
    b1: dict[str, Any] = {}
    b0: dict[str, Any] = {}
    t1 = _run_mesh(_Mesh(1, 2, JOB, secret_b, addr1, deadline, timeout), l1, {}, b1)
    held = []
    for data in strangers or []:
        s = socket.create_connection(("127.0.0.1", l1.getsockname()[1]))
        s.sendall(data)
        held.append(s)
    t0 = _run_mesh(_Mesh(0, 2, JOB, secret_a, addr0, deadline, timeout), l0, {1: addr1}, b0)
    t0.join(timeout + 5)
    t1.join(timeout + 5)
    for s in held:
        s.close()
    l0.close()
    l1.close()
    return b0, b1


def _close(box: dict[str, Any]) -> None:
    for s in box.get("socks", {}).values():
        s.close()


def test_hello_connects_a_pair() -> None:
    b0, b1 = _pair()
    assert set(b0["socks"]) == {1} and set(b1["socks"]) == {0}
    _close(b0)
    _close(b1)


def test_wrong_secret_fails_on_the_connector() -> None:
    b0, b1 = _pair(secret_a=b"x" * 32, timeout=3.0)
    assert isinstance(b0["error"], ProtocolError)
    assert "prove" in str(b0["error"])
    assert "socks" not in b1  # the acceptor never took the impostor


@pytest.mark.parametrize("garbage", [
    b"",
    b"GET / HTTP/1.0\r\n\r\n",
    b"\x00" * handshake.HELLO_SIZE,
    handshake.Hello(handshake.KIND_HELLO, 0, 2, JOB, b"n" * 16).pack(),  # right hello, no proof
    handshake.Hello(handshake.KIND_HELLO, 0, 2, JOB, b"n" * 16).pack() + b"p" * 32,
])
def test_strangers_are_dropped_and_the_job_connects(garbage: bytes) -> None:
    b0, b1 = _pair(strangers=[garbage, garbage])
    assert set(b0["socks"]) == {1} and set(b1["socks"]) == {0}, (b0, b1)
    _close(b0)
    _close(b1)


def test_replayed_hello_does_not_verify() -> None:
    """A recorded connector proof is bound to the acceptor's nonce of that connection."""
    nonce_a, old_nonce_b = auth.new_nonce(), auth.new_nonce()
    addr = "5000 127.0.0.1"
    recorded = handshake.proof(SECRET, "connect", JOB, 2, 0, 1, nonce_a, old_nonce_b, addr)
    fresh_nonce_b = auth.new_nonce()
    assert not handshake.verify(SECRET, recorded, "connect", JOB, 2, 0, 1, nonce_a,
                                fresh_nonce_b, addr)
    # Direction and ranks are bound too.
    assert not handshake.verify(SECRET, recorded, "accept", JOB, 2, 0, 1, nonce_a,
                                old_nonce_b, addr)
    assert not handshake.verify(SECRET, recorded, "connect", JOB, 2, 1, 0, nonce_a,
                                old_nonce_b, addr)
    assert handshake.verify(SECRET, recorded, "connect", JOB, 2, 0, 1, nonce_a, old_nonce_b,
                            addr)


def test_a_relay_between_the_ranks_is_detected() -> None:
    """Rank 0 is told (as by an overwritten store key) that rank 1 is at the relay's address;
    the relay forwards bytes both ways. The proofs cover the address rank 0 dialed, so rank 0
    refuses the connection."""
    timeout = 5.0
    deadline = time.monotonic() + timeout
    l1, addr1 = _listener()
    l0, addr0 = _listener()
    relay, relay_addr = _listener()
    stop = threading.Event()

    def pump(src: socket.socket, dst: socket.socket) -> None:
        src.settimeout(0.2)
        while not stop.is_set():
            try:
                data = src.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            if not data:
                return
            dst.sendall(data)

    def run_relay() -> None:
        conn, _ = relay.accept()
        up = socket.create_connection(("127.0.0.1", l1.getsockname()[1]))
        for a, b in ((conn, up), (up, conn)):
            threading.Thread(target=pump, args=(a, b), daemon=True).start()

    threading.Thread(target=run_relay, daemon=True).start()
    b1: dict[str, Any] = {}
    b0: dict[str, Any] = {}
    t1 = _run_mesh(_Mesh(1, 2, JOB, SECRET, addr1, deadline, timeout), l1, {}, b1)
    t0 = _run_mesh(_Mesh(0, 2, JOB, SECRET, addr0, deadline, timeout), l0, {1: relay_addr},
                   b0)
    t0.join(timeout + 5)
    t1.join(timeout + 5)
    stop.set()
    for s in (l0, l1, relay):
        s.close()
    assert isinstance(b0.get("error"), ProtocolError), b0
    assert "socks" not in b1, b1


@settings(max_examples=150, deadline=None)
@given(st.binary(min_size=handshake.HELLO_SIZE, max_size=handshake.ACCEPT_SIZE))
def test_hello_parser_takes_any_bytes(data: bytes) -> None:
    h = handshake.Hello.unpack(data)
    assert h.matches(handshake.KIND_HELLO, 2, JOB) == (
        data[:4] == handshake.Hello(1, 0, 2, JOB, b"").pack()[:4]
        and h.version == 1 and h.kind == 1 and h.size == 2 and h.job_id == JOB)
    assert not handshake.verify(SECRET, data[:32], "connect", JOB, 2, 0, 1, b"a", b"b", "x")
