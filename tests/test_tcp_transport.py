"""The TCP transport: real processes on 127.0.0.1 (see tests/tcp_world.py), plus a few
single-process tests of set-up, the handshake wire format and clean closes."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import struct
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from errcheck import raises_comm, raises_usage
from multiproc import run_world as multiproc_run_world
from tcp_world import free_port, make_event, run_world, set_up_two, wait_dead

import bitcoll
from bitcoll.communicator import Communicator
from bitcoll.config import ENV_SEND_BUFFER
from bitcoll.errors import CommError, CommTimeoutError, PeerLostError, ProtocolError, UsageError
from bitcoll.transport import netio
from bitcoll.transport.base import HEADER_SIZE, MAGIC, PROTOCOL_VERSION, FrameHeader
from bitcoll.transport.rendezvous import auth, handshake
from bitcoll.transport.rendezvous.store import StoreClient, StoreServer
from bitcoll.transport.rendezvous.tcp_bootstrap import send_buffer_bytes
from bitcoll.transport.tcp.transport import (
    CONSUME_CHUNK_BYTES,
    KEY_ABORT,
    KEY_ADDR,
    KEY_INTEGRITY,
    KEY_JOB,
    KEY_SIZE,
    RECEIVE_BUFFER_BYTES,
    SEND_BUFFER_BYTES,
    PeerState,
    RxPhase,
    TCPTransport,
)

pytestmark = pytest.mark.tcp

SIG = 0x5EED
MiB = 1 << 20


def _data(src: int, dst: int, tag: int, n: int) -> np.ndarray:
    """The payload ``src`` sends to ``dst`` as frame ``tag``: reproducible from the seeds."""
    return np.random.default_rng([src, dst, tag]).integers(0, 256, n, dtype=np.uint8)


def _view(a: np.ndarray) -> memoryview:
    return a.data


class _Checker:
    """Posts frames, remembers what must arrive, counts expected traffic."""

    def __init__(self, t: TCPTransport) -> None:
        self.t = t
        self.reqs: list[Any] = []
        self.checks: list[tuple[int, int, np.ndarray]] = []
        self.sent = self.received = self.msent = self.mreceived = 0
        self.step: dict[tuple[str, int, int], int] = {}
        self.keep: list[np.ndarray] = []

    def _hdr(self, kind: str, seq: int, peer: int, n: int) -> FrameHeader:
        step = self.step.get((kind, seq, peer), 0)
        self.step[(kind, seq, peer)] = step + 1
        return FrameHeader(seq=seq, step=step, signature=SIG, length=n)

    def send(self, seq: int, peer: int, tag: int, n: int) -> None:
        a = _data(self.t.rank, peer, tag, n)
        self.keep.append(a)
        self.reqs.append(self.t.isend(peer, _view(a), self._hdr("s", seq, peer, n)))
        self.sent += self.t.frame_overhead + n
        self.msent += 1

    def recv(self, seq: int, peer: int, tag: int, n: int) -> None:
        b = np.full(n, 0xAA, dtype=np.uint8)
        self.reqs.append(self.t.irecv(peer, _view(b), self._hdr("r", seq, peer, n)))
        self.checks.append((peer, tag, b))
        self.received += self.t.frame_overhead + n
        self.mreceived += 1

    def finish(self, deadline: float) -> list[str]:
        for r in self.reqs:
            r.wait(deadline)
        assert all(r.done() for r in self.reqs)
        bad = [f"rank {self.t.rank}: frame {tag} from rank {peer} ({b.size} bytes) differs"
               for peer, tag, b in self.checks
               if not np.array_equal(b, _data(peer, self.t.rank, tag, b.size))]
        self.reqs, self.checks, self.keep = [], [], []
        return bad


def worker_patterns(t: TCPTransport) -> dict[str, Any]:
    """Ring, all pairs, zero/one-byte and multi-MiB payloads, hundreds of frames in flight."""
    p, r = t.size, t.rank
    right, left = (r + 1) % p, (r - 1) % p
    deadline = time.monotonic() + 60.0
    before = t.stats.snapshot()
    c = _Checker(t)
    problems: list[str] = []
    # 1. ring, receives posted before the sends, every size class
    sizes = [0, 1, 1000, 3 * MiB + 5]
    for i, n in enumerate(sizes):
        c.recv(1, left, i, n)
    for i, n in enumerate(sizes):
        c.send(1, right, i, n)
    problems += c.finish(deadline)
    # 2. all pairs at once, sends posted before the receives
    pair_sizes = [0, 7, 65536 + 3]
    for q in range(p):
        if q != r:
            for i, n in enumerate(pair_sizes):
                c.send(2, q, 100 + i, n)
    for q in range(p):
        if q != r:
            for i, n in enumerate(pair_sizes):
                c.recv(2, q, 100 + i, n)
    problems += c.finish(deadline)
    # 3. many frames in flight to the right while receiving as many from the left
    count = 300

    def lengths(src: int) -> np.ndarray:
        return np.random.default_rng([src, 77]).integers(0, 20000, count)

    for i, n in enumerate(lengths(left)):
        c.recv(3, left, 1000 + i, int(n))
    for i, n in enumerate(lengths(r)):
        c.send(3, right, 1000 + i, int(n))
    problems += c.finish(deadline)
    # 4. one large frame each way between ring neighbours, sent before the receive is posted
    c.send(4, right, 5000, 8 * MiB)
    # The left neighbour's frame has started to arrive before the receive is posted.
    assert select.select([t._peers[left].sock], [], [], 30.0)[0]
    c.recv(4, left, 5000, 8 * MiB)
    problems += c.finish(deadline)
    after = t.stats.snapshot()
    delta = {k: after[k] - before[k] for k in after}
    expected = {"bytes_sent": c.sent, "bytes_received": c.received,
                "messages_sent": c.msent, "messages_received": c.mreceived}
    if delta != expected:
        problems.append(f"rank {r}: stats {delta} != expected {expected}")
    if t.failure is not None:
        problems.append(f"rank {r}: failure {t.failure!r}")
    return {"problems": problems, "stats": delta}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", [2, 3, 4, 5])
def test_patterns_payloads_and_exact_stats(size: int) -> None:
    results = run_world(size, worker_patterns, timeout=100)
    for res in results:
        out = res.unwrap()
        assert out["problems"] == []
    # Traffic is conserved: everything sent was received somewhere.
    sent = sum(r.value["stats"]["bytes_sent"] for r in results)
    received = sum(r.value["stats"]["bytes_received"] for r in results)
    assert sent == received > 0


def worker_mismatch(t: TCPTransport) -> tuple[str, str, float, str]:
    """Rank 1 sends rank 0 a frame with the wrong step; everybody must fail fast."""
    deadline = time.monotonic() + 30.0
    buf = np.zeros(16, dtype=np.uint8)
    if t.rank == 1:
        t.isend(0, _view(buf), FrameHeader(seq=3, step=1, signature=SIG, length=16)).wait(
            deadline)
    t0 = time.monotonic()
    try:
        if t.rank == 0:
            t.irecv(1, _view(buf), FrameHeader(seq=3, step=0, signature=SIG, length=16)).wait(
                deadline)
        else:
            # Nobody sends this: only the abort can end the wait before the deadline.
            t.irecv(0, _view(buf), FrameHeader(seq=3, step=0, signature=SIG, length=16)).wait(
                deadline)
    except CommError as exc:
        elapsed = time.monotonic() - t0
        after = ""
        try:
            t.isend((t.rank + 1) % t.size, _view(buf),
                    FrameHeader(seq=4, step=0, signature=SIG, length=16))
        except CommError as later:
            after = type(later).__name__
        assert t.failure is not None
        return type(exc).__name__, str(exc), elapsed, after
    return "none", "", time.monotonic() - t0, ""


@pytest.mark.timeout(60)
def test_header_mismatch_is_protocol_error_and_aborts_everyone() -> None:
    results = [r.unwrap() for r in run_world(3, worker_mismatch, timeout=50)]
    kind0, msg0, _, after0 = results[0]
    assert kind0 == "ProtocolError"
    assert "rank 1 sent step 1, expected step 0" in msg0
    assert after0 == "ProtocolError"  # every later call raises the failure
    for kind, msg, elapsed, after in results[1:]:
        assert kind == "PeerLostError", msg
        assert "rank 0 aborted" in msg and "step 1" in msg
        assert elapsed < 30.0  # before the deadline: the abort ended the wait
        assert after == "PeerLostError"


def _receive_the_cut_frame(t: TCPTransport, sender: int, step: int, nbytes: int,
                           deadline: float) -> None:
    """Rank 0 receives the ``nbytes`` frame of ``step`` from ``sender``, the one cut short;
    the other survivors wait for a 4-byte frame from rank 0 that never comes."""
    if t.rank == 0:
        dst = np.zeros(nbytes, dtype=np.uint8)
        t.irecv(sender, _view(dst), FrameHeader(seq=1, step=step, signature=SIG,
                                                length=nbytes)).wait(deadline)
    else:
        buf = np.zeros(4, dtype=np.uint8)
        t.irecv(0, _view(buf), FrameHeader(seq=1, step=0, signature=SIG, length=4)).wait(
            deadline)


def worker_kill(t: TCPTransport) -> tuple[str, str, float]:
    """Rank 2 dies with SIGKILL while its 64 MiB frame to rank 0 is half way.

    Rank 0 reads the frame only after rank 2 is dead, so the frame is always cut; rank 1 waits
    for a frame from rank 0, so it learns about the loss only through rank 0's abort.
    """
    deadline = time.monotonic() + 30.0
    big = 64 * MiB
    if t.rank == 2:
        pid = np.array([os.getpid()], dtype=np.int64)
        t.isend(0, pid.view(np.uint8).data, FrameHeader(seq=1, step=0, signature=SIG,
                                                        length=8)).wait(deadline)
        src = np.ones(big, dtype=np.uint8)
        req = t.isend(0, _view(src), FrameHeader(seq=1, step=1, signature=SIG, length=big))
        # isend wrote what the empty socket buffer took: the frame is under way and, being
        # far larger than the buffers, cannot be complete.
        assert not req.done()
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        if t.rank == 0:
            pid = np.zeros(1, dtype=np.int64)
            t.irecv(2, pid.view(np.uint8).data, FrameHeader(seq=1, step=0, signature=SIG,
                                                            length=8)).wait(deadline)
            wait_dead(int(pid[0]), deadline)
            t0 = time.monotonic()
        _receive_the_cut_frame(t, 2, 1, big, deadline)
    except CommError as exc:
        return type(exc).__name__, str(exc), time.monotonic() - t0
    return "none", "", time.monotonic() - t0


@pytest.mark.timeout(60)
def test_peer_killed_mid_transfer_fails_survivors_quickly() -> None:
    results = run_world(3, worker_kill, timeout=50)
    assert results[2].exitcode == -signal.SIGKILL
    kind0, msg0, elapsed0 = results[0].unwrap()
    assert kind0 == "PeerLostError"
    assert msg0.startswith("lost the connection to rank 2")
    assert elapsed0 < 30.0  # before the deadline: the loss was detected, not waited out
    kind1, msg1, elapsed1 = results[1].unwrap()
    assert kind1 == "PeerLostError"
    assert msg1.startswith("rank 0 aborted: lost the connection to rank 2")
    assert elapsed1 < 30.0  # before the deadline: rank 0's abort ended the wait


def worker_abort(t: TCPTransport, aborted: Any) -> tuple[str, str, float, str]:
    """Rank 1 aborts while its 32 MiB frame to rank 0 is half way."""
    deadline = time.monotonic() + 30.0
    big = 32 * MiB
    if t.rank == 1:
        src = np.ones(big, dtype=np.uint8)
        req = t.isend(0, _view(src), FrameHeader(seq=1, step=0, signature=SIG, length=big))
        t.abort("boom")
        aborted.set()
        try:
            req.wait(deadline)
        except CommError as exc:
            failure = t.failure
            return type(exc).__name__, str(exc), 0.0, type(failure).__name__
        return "none", "", 0.0, ""
    t0 = time.monotonic()
    try:
        if t.rank == 0:
            assert aborted.wait(20)  # read the frame only once rank 1 has given up on it
            t0 = time.monotonic()
        _receive_the_cut_frame(t, 1, 0, big, deadline)
    except CommError as exc:
        return type(exc).__name__, str(exc), time.monotonic() - t0, type(t.failure).__name__
    return "none", "", time.monotonic() - t0, ""


@pytest.mark.timeout(60)
def test_abort_reaches_every_peer_with_its_reason() -> None:
    results = [r.unwrap() for r in run_world(3, worker_abort, make_event(), timeout=50)]
    kind1, msg1, _, failure1 = results[1]
    assert kind1 == "CommError" and failure1 == "CommError"
    assert msg1 == "rank 1 aborted: boom"
    for kind, msg, elapsed, failure in (results[0], results[2]):
        assert kind == "PeerLostError" and failure == "PeerLostError"
        assert "rank 1 aborted: boom" in msg
        assert elapsed < 30.0  # before the deadline: the abort ended the wait


def worker_timeout(t: TCPTransport, done: Any) -> tuple[str, float, bool]:
    buf = np.zeros(8, dtype=np.uint8)
    if t.rank == 0:
        t0 = time.monotonic()
        req = t.irecv(1, _view(buf), FrameHeader(seq=1, step=0, signature=SIG, length=8))
        try:
            req.wait(t0 + 0.5)
        except CommTimeoutError as exc:
            return str(exc), time.monotonic() - t0, t.failure is None and not req.done()
        finally:
            done.set()
        return "no timeout", time.monotonic() - t0, False
    assert done.wait(30)  # stay connected until rank 0 has seen its time-out
    return "", 0.0, True


@pytest.mark.timeout(60)
def test_receive_nobody_sends_times_out_at_the_deadline() -> None:
    msg, elapsed, healthy = run_world(2, worker_timeout, make_event(), timeout=50)[0].unwrap()
    assert "receive from rank 1" in msg and "deadline" in msg
    assert elapsed >= 0.5  # not before the deadline
    assert healthy


# --------------------------------------------------------------------------------------------
# Single-process tests (ranks as threads, or a hand-made peer)
# --------------------------------------------------------------------------------------------


def _create_in_threads(size: int, ranks: list[int], port: int, timeout: float,
                       send_buffer: dict[int, Any] | None = None
                       ) -> dict[int, TCPTransport | BaseException]:
    """Each rank of ``ranks`` creates its transport in a thread (``send_buffer``: the
    ``send_buffer`` argument of some ranks); their transports or errors."""
    out: dict[int, TCPTransport | BaseException] = {}

    def run(r: int) -> None:
        try:
            out[r] = TCPTransport.create(r, size, "127.0.0.1", port, timeout=timeout,
                                         send_buffer=(send_buffer or {}).get(r))
        except BaseException as exc:
            out[r] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in ranks]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout + 10)
    return out


@pytest.mark.timeout(30)
def test_create_with_a_missing_rank_times_out_naming_it() -> None:
    out = _create_in_threads(3, [0, 1], free_port(), timeout=1.5)
    for r in (0, 1):
        err = out[r]
        assert isinstance(err, CommTimeoutError), repr(err)
        assert "rank 2 never showed up" in str(err)


@pytest.mark.timeout(30)
def test_create_without_rank_0_times_out_naming_it() -> None:
    out = _create_in_threads(2, [1], free_port(), timeout=1.0)
    assert isinstance(out[1], CommTimeoutError)
    assert "rank 0 never showed up" in str(out[1])


def test_world_of_one_needs_no_socket() -> None:
    t = TCPTransport.create(0, 1, "no-such-host.invalid", 0)
    assert (t.rank, t.size, t.failure) == (0, 1, None)
    with pytest.raises(UsageError):
        t.isend(0, memoryview(b""), FrameHeader(0, 0, 0, 0))
    t.close()
    t.close()


@pytest.mark.parametrize("args", [(2, 2, 5000), (-1, 2, 5000), (0, 0, 5000), (1, 2, 0)])
def test_create_rejects_bad_arguments(args: tuple[int, int, int]) -> None:
    rank, size, port = args
    with pytest.raises(UsageError):
        TCPTransport.create(rank, size, "127.0.0.1", port, timeout=1.0)


def _buffers(t: TCPTransport) -> list[tuple[int, int]]:
    """(SO_SNDBUF, SO_RCVBUF) of each of ``t``'s data connections."""
    return [(p.sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF),
             p.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF))
            for p in t._peers.values()]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("setting", [None, "65536", "0"])
def test_data_connections_get_the_send_buffer_asked_for(monkeypatch: pytest.MonkeyPatch,
                                                        setting: str | None) -> None:
    """The default send buffer, BITCOLL_SEND_BUFFER's, or the kernel's own (0); the receive
    buffer raised to RECEIVE_BUFFER_BYTES either way (Linux reports twice what was set)."""
    if setting is None:
        monkeypatch.delenv(ENV_SEND_BUFFER, raising=False)
    else:
        monkeypatch.setenv(ENV_SEND_BUFFER, setting)
    fresh = socket.socket()
    kernel = fresh.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
    fresh.close()
    asked = SEND_BUFFER_BYTES if setting is None else int(setting)
    out = _create_in_threads(3, [0, 1, 2], free_port(), timeout=20.0)
    try:
        for r in range(3):
            t = out[r]
            assert isinstance(t, TCPTransport), repr(t)
            bufs = _buffers(t)
            assert len(bufs) == 2
            for send, receive in bufs:
                assert receive >= RECEIVE_BUFFER_BYTES
                if asked:
                    assert send in (asked, 2 * asked)
                else:  # left to the kernel: it starts where a fresh socket does and may grow
                    assert send >= kernel and send not in (SEND_BUFFER_BYTES,
                                                           2 * SEND_BUFFER_BYTES)
    finally:
        _close_together(out)


def _close_together(out: dict[int, TCPTransport | BaseException]) -> None:
    """Close the transports among ``out`` at once (rank 0 keeps its store until the others
    have closed)."""
    closers = [threading.Thread(target=t.close) for t in out.values()
               if isinstance(t, TCPTransport)]
    for th in closers:
        th.start()
    for th in closers:
        th.join(30)


@pytest.mark.parametrize("text", ["abc", "-1", "1.5", "64K", str(1 << 31)])
def test_a_bad_send_buffer_variable_is_a_usage_error(monkeypatch: pytest.MonkeyPatch,
                                                     text: str) -> None:
    monkeypatch.setenv(ENV_SEND_BUFFER, text)
    with raises_usage(ENV_SEND_BUFFER):
        send_buffer_bytes()
    with raises_usage(ENV_SEND_BUFFER):  # a world of one checks it too
        TCPTransport.create(0, 1, "127.0.0.1", 0)
    assert send_buffer_bytes(4096) == 4096  # an argument wins over the variable


@pytest.mark.parametrize("value", [-1, 1 << 31, 1.5, True, "65536"])
def test_a_bad_send_buffer_argument_is_a_usage_error(value: Any) -> None:
    with raises_usage("send_buffer"):
        send_buffer_bytes(value)
    with raises_usage("send_buffer"):
        TCPTransport.create(0, 1, "127.0.0.1", 0, send_buffer=value)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("bad", [0, 2])
def test_a_rank_with_a_bad_send_buffer_refuses_and_the_others_fail_at_once(bad: int) -> None:
    """Rank ``bad`` of 3 passes a negative send buffer: it raises UsageError and says so in
    the store, so the others fail with PeerLostError naming it (not at their 20 s deadline,
    which would be a CommTimeoutError)."""
    out = _create_in_threads(3, [0, 1, 2], free_port(), timeout=20.0, send_buffer={bad: -1})
    try:
        assert isinstance(out[bad], UsageError), out
        assert f"rank {bad}: send_buffer" in str(out[bad])
        for r in {0, 1, 2} - {bad}:
            err = out[r]
            assert isinstance(err, PeerLostError), out
            assert err.peer == bad and "refused" in str(err) and "send_buffer" in str(err)
    finally:
        _close_together(out)


def _send_buffers_via_init(comm: Communicator) -> list[int]:
    t = comm.transport
    assert isinstance(t, TCPTransport)
    return [send for send, _ in _buffers(t)]


@pytest.mark.timeout(120)
def test_init_passes_send_buffer_to_the_connections() -> None:
    """``bitcoll.init(send_buffer=...)`` reaches every data connection (Linux reports twice
    the value); it belongs to the TCP backend only."""
    got = multiproc_run_world(3, _send_buffers_via_init, shm=False, send_buffer=65536)
    assert got == [[2 * 65536] * 2] * 3 or got == [[65536] * 2] * 3, got
    with raises_usage("send_buffer"):
        bitcoll.init("local", send_buffer=65536)


@pytest.mark.timeout(60)
def test_a_bad_send_buffer_variable_on_every_rank_fails_each_with_usage_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_SEND_BUFFER, "lots")
    out = _create_in_threads(2, [0, 1], free_port(), timeout=20.0)
    try:
        for r in (0, 1):
            assert isinstance(out[r], UsageError), out
            assert ENV_SEND_BUFFER in str(out[r])
    finally:
        _close_together(out)


SECRET = "test-secret"


def _k(suffix: str) -> str:
    """A key of the transport's namespace in its own store."""
    return "bitcoll/" + suffix


@contextlib.contextmanager
def _rank1(monkeypatch: pytest.MonkeyPatch, port: int, size: int,
           job: int) -> Iterator[tuple[StoreClient, dict[str, Any], threading.Thread]]:
    """A store playing rank 0's part (its client), and rank 1 creating its transport in a
    thread that leaves it (or its error) in the box under ``"t"`` (``"err"``), with
    BITCOLL_SECRET set to :data:`SECRET`. At the end the thread is joined and the store
    closed."""
    monkeypatch.setenv("BITCOLL_SECRET", SECRET)
    monkeypatch.setenv("BITCOLL_CHECKSUM", "0")  # the raw rank 0 writes frames without one
    server = StoreServer("127.0.0.1", port, secret=SECRET.encode())
    client = StoreClient.connect("127.0.0.1", port, time.monotonic() + 5,
                                 secret=SECRET.encode())
    client.set(_k(KEY_SIZE), b"2")
    client.set(_k(KEY_INTEGRITY), b"0")
    client.set(_k(KEY_JOB), str(job).encode())
    client.set(_k(KEY_ADDR.format(0)), b"1 127.0.0.1")  # never used: 0 connects to 1
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["t"] = TCPTransport.create(1, size, "127.0.0.1", port, timeout=20.0)
        except BaseException as exc:
            box["err"] = exc

    th = threading.Thread(target=run)
    th.start()
    try:
        yield client, box, th
    finally:
        th.join(10)
        client.close()
        server.close()


def _published(client: StoreClient, box: dict[str, Any], th: threading.Thread) -> str:
    """The address rank 1 (started by :func:`_rank1`) published; an assertion naming
    its error when it never does."""
    try:
        return client.get(_k(KEY_ADDR.format(1)), time.monotonic() + 20).decode()
    except CommTimeoutError:
        th.join(1)
        raise AssertionError(f"rank 1 never published its address: {box}") from None


def _hello_as_rank0(published: str, job: int) -> socket.socket:
    """Run rank 0's side of the authenticated hello with rank 1 at ``published``."""
    port_s, host = published.split(" ", 1)
    peer = socket.create_connection((host, int(port_s)), timeout=5)
    nonce_a = auth.new_nonce()
    peer.sendall(handshake.Hello(handshake.KIND_HELLO, 0, 2, job, nonce_a).pack())
    ack = peer.recv(handshake.ACCEPT_SIZE, socket.MSG_WAITALL)
    h = handshake.Hello.unpack(ack)
    assert (h.magic, h.version, h.kind, h.rank, h.size, h.job_id) == (
        MAGIC, PROTOCOL_VERSION, handshake.KIND_ACCEPT, 1, 2, job)
    assert handshake.verify(SECRET.encode(), ack[handshake.HELLO_SIZE:], "accept", job, 2, 0,
                            1, nonce_a, h.nonce, published)
    peer.sendall(handshake.proof(SECRET.encode(), "connect", job, 2, 0, 1, nonce_a, h.nonce,
                                 published))
    done = peer.recv(handshake.DONE_SIZE, socket.MSG_WAITALL)  # rank 1 keeps the connection
    assert handshake.verify(SECRET.encode(), done, "done", job, 2, 0, 1, nonce_a, h.nonce,
                            published)
    return peer


@pytest.mark.timeout(30)
def test_handshake_rejects_stale_peers_and_frames_follow_the_wire_format(
        monkeypatch: pytest.MonkeyPatch) -> None:
    port, job = free_port(), 0x1234_5678_9ABC
    with _rank1(monkeypatch, port, 2, job) as (client, box, th):
        published = _published(client, box, th)
        port_s, host = published.split()
        addr = (host, int(port_s))
        # A process of another job is dropped without an answer.
        with socket.create_connection(addr, timeout=5) as stale:
            stale.sendall(handshake.Hello(handshake.KIND_HELLO, 0, 2, job + 1,
                                          auth.new_nonce()).pack())
            assert stale.recv(64) == b""
        # The real rank 0 completes the hello.
        peer = _hello_as_rank0(published, job)
        th.join(10)
        t = box["t"]
        assert isinstance(t, TCPTransport) and t.job_id == job
        # A frame is the 32-byte header then the payload, nothing else.
        payload = bytes(range(200))
        peer.sendall(FrameHeader(seq=9, step=0, signature=SIG, length=200).pack() + payload)
        got = bytearray(200)
        t.irecv(0, memoryview(got), FrameHeader(seq=9, step=0, signature=SIG, length=200)).wait(
            time.monotonic() + 5)
        assert bytes(got) == payload
        t.isend(0, memoryview(b"xyz"), FrameHeader(seq=9, step=0, signature=SIG, length=3)).wait(
            time.monotonic() + 5)
        raw = b""
        while len(raw) < HEADER_SIZE + 3:
            raw += peer.recv(HEADER_SIZE + 3 - len(raw))
        assert FrameHeader.unpack(raw[:HEADER_SIZE]) == FrameHeader(seq=9, step=0,
                                                                  signature=SIG, length=3)
        assert raw[HEADER_SIZE:] == b"xyz"
        assert t.stats.snapshot() == {"bytes_sent": HEADER_SIZE + 3,
                                      "bytes_received": HEADER_SIZE + 200,
                                      "messages_sent": 1, "messages_received": 1}
        # A clean close between frames is not a failure by itself ...
        peer.close()
        _progress_until(t, lambda: t.peer_state(0) is PeerState.PEER_CLOSED)
        failure_before = t.failure
        assert failure_before is None
        # ... but the next call involving the peer is.
        with raises_comm(PeerLostError, peer=0, rank=1):
            t.irecv(0, memoryview(got), FrameHeader(seq=10, step=0, signature=SIG, length=200))
        assert isinstance(t.failure, PeerLostError)
        t.close()
        with pytest.raises(UsageError):
            t.isend(0, memoryview(b""), FrameHeader(0, 0, 0, 0))


@pytest.mark.timeout(30)
def test_world_size_disagreement_is_a_usage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    with _rank1(monkeypatch, free_port(), 3, 1) as (_, box, th):
        th.join(10)
        assert isinstance(box.get("err"), UsageError)
        assert "world size 3" in str(box["err"])


@pytest.mark.timeout(30)
def test_threads_world_garbage_header_is_protocol_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer writing a frame with a bad magic number fails the receiver with ProtocolError."""
    with _raw_pair(monkeypatch) as (t, peer, _):
        buf = bytearray(4)
        req = t.irecv(0, memoryview(buf), FrameHeader(seq=1, step=0, signature=SIG, length=4))
        peer.sendall(b"\x00" * HEADER_SIZE)
        with pytest.raises(ProtocolError, match="magic"):
            req.wait(time.monotonic() + 5)
        # The aborting rank told the peer why, with an ABORT frame.
        peer.settimeout(5)
        head = peer.recv(HEADER_SIZE, socket.MSG_WAITALL)
        h = FrameHeader.unpack(head)
        reason = peer.recv(h.length, socket.MSG_WAITALL).decode()
        assert h.kind == 2 and "magic" in reason


def _until_inside(thread: threading.Thread, function: str, seconds: float = 10.0) -> None:
    """Return once ``thread`` is executing ``function`` (it is on its stack)."""
    end = time.monotonic() + seconds
    while True:
        frame = sys._current_frames().get(thread.ident or -1)
        while frame is not None:
            if frame.f_code.co_name == function:
                return
            frame = frame.f_back
        assert time.monotonic() < end, f"the thread never entered {function}"
        time.sleep(0.001)  # polls a condition; sets up no interleaving


@pytest.mark.timeout(30)
def test_rank_0_keeps_the_store_until_the_others_close() -> None:
    out = _create_in_threads(2, [0, 1], free_port(), timeout=10)
    t0, t1 = out[0], out[1]
    assert isinstance(t0, TCPTransport) and isinstance(t1, TCPTransport)
    closer = threading.Thread(target=t0.close)
    closer.start()
    _until_inside(closer, "wait_idle")  # rank 0 waits for rank 1 to leave the store ...
    assert closer.is_alive()
    store = t1._store
    assert store is not None and store.try_get(t1._key(KEY_JOB)) == str(t1.job_id).encode()
    t1.close()
    closer.join(20)  # ... and returns once it left, not at its 30 s close deadline
    assert not closer.is_alive()
    t0.close()  # idempotent


def worker_consume(t: TCPTransport, fail: bool) -> tuple[str, str, list[int]]:
    """Rank 0 sends frames to rank 1, which takes some with irecv_consume: every byte must
    reach the consumer once, in order, in pieces of at most CONSUME_CHUNK_BYTES that are
    multiples of 8 bytes except the last; normal receives in between still work. With
    ``fail``, rank 1's consumer raises on the second piece: both ranks must fail."""
    deadline = time.monotonic() + 30.0
    sizes = [0, 5, CONSUME_CHUNK_BYTES, 3 * CONSUME_CHUNK_BYTES + 13, 1000]
    try:
        if t.rank == 0:
            frames = [_data(0, 1, i, n) for i, n in enumerate(sizes)]
            reqs = [t.isend(1, _view(a), FrameHeader(seq=1, step=i, signature=SIG, length=n))
                    for i, (a, n) in enumerate(zip(frames, sizes, strict=True))]
            for r in reqs:
                r.wait(deadline)
            t.irecv(1, memoryview(bytearray(1)),
                    FrameHeader(seq=2, step=0, signature=SIG, length=1)).wait(deadline)
            return "ok", "", []
        got: list[bytearray] = [bytearray() for _ in sizes]
        pieces: list[int] = []
        calls = 0

        def consumer(i: int) -> Any:
            def consume(offset: int, chunk: memoryview) -> None:
                nonlocal calls
                calls += 1
                if fail and calls == 2:
                    raise RuntimeError("consumer broke")
                assert offset == len(got[i])
                got[i] += bytes(chunk)
                pieces.append(len(chunk))
            return consume

        reqs = []
        for i, n in enumerate(sizes):
            hdr = FrameHeader(seq=1, step=i, signature=SIG, length=n)
            if i == 4:  # an ordinary receive after the consumed ones
                buf = np.zeros(n, np.uint8)
                reqs.append(t.irecv(0, _view(buf), hdr))
            else:
                reqs.append(t.irecv_consume(0, n, hdr, consumer(i)))
        for r in reqs:
            r.wait(deadline)
        bad = [i for i in range(4) if bytes(got[i]) != _data(0, 1, i, sizes[i]).tobytes()]
        assert not bad and np.array_equal(buf, _data(0, 1, 4, sizes[4])), bad
        t.isend(0, memoryview(b"x"), FrameHeader(seq=2, step=0, signature=SIG, length=1)
                ).wait(deadline)
        return "ok", "", pieces
    except CommError as exc:
        return type(exc).__name__, str(exc), []


def test_irecv_consume_hands_over_every_byte_in_order() -> None:
    (k0, _, _), (k1, _, pieces) = (r.unwrap() for r in run_world(2, worker_consume, False,
                                                                   timeout=60))
    assert (k0, k1) == ("ok", "ok")
    assert sum(pieces) == 5 + CONSUME_CHUNK_BYTES + 3 * CONSUME_CHUNK_BYTES + 13
    assert max(pieces) <= CONSUME_CHUNK_BYTES
    assert all(n % 8 == 0 for n in pieces[1:-1])


def test_failing_consumer_fails_every_rank() -> None:
    (k0, m0, _), (k1, m1, _) = (r.unwrap() for r in run_world(2, worker_consume, True,
                                                                timeout=60))
    assert k1 == "CommError" and "consumer broke" in m1, (k1, m1)
    assert k0 == "PeerLostError" and "consumer broke" in m0, (k0, m0)


# --------------------------------------------------------------------------------------------
# State transitions of one connection (rank 1's transport, a raw socket playing rank 0)
# --------------------------------------------------------------------------------------------


def _progress_until(t: TCPTransport, cond: Any, seconds: float = 10.0) -> None:
    """Call ``t.progress()`` until ``cond()`` holds (the bytes the test wrote have been read);
    fail after ``seconds``. Polls a condition; sets up no interleaving."""
    end = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < end, "the transport never got there"
        t.progress()
        select.select([], [], [], 0.001)


@contextlib.contextmanager
def _raw_pair(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[TCPTransport, socket.socket,
                                                                  StoreClient]]:
    """Rank 1's transport, the raw socket of rank 0's side of their connection, and the store
    client (rank 0 leaves abort reasons there)."""
    port, job = free_port(), 4242
    peer: socket.socket | None = None
    with _rank1(monkeypatch, port, 2, job) as (client, box, th):
        try:
            published = _published(client, box, th)
            peer = _hello_as_rank0(published, job)
            th.join(10)
            t = box["t"]
            assert isinstance(t, TCPTransport) and t.peer_state(0) is PeerState.OPEN
            try:
                yield t, peer, client
            finally:
                t.close()
        finally:
            if peer is not None:
                peer.close()


def _rx(t: TCPTransport) -> RxPhase:
    return t._peers[0].rx_phase


def _hdr(n: int, seq: int = 5) -> FrameHeader:
    return FrameHeader(seq=seq, step=0, signature=SIG, length=n)


def _reset(s: socket.socket) -> None:
    """Close ``s`` with a TCP reset instead of a clean end of stream."""
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()


def _read_abort(peer: socket.socket) -> str:
    """The reason of the ABORT frame rank 1 sent rank 0."""
    peer.settimeout(5)
    h = FrameHeader.unpack(peer.recv(HEADER_SIZE, socket.MSG_WAITALL))
    assert h.kind == 2
    return peer.recv(h.length, socket.MSG_WAITALL).decode()


@pytest.mark.timeout(30)
def test_state_clean_close_with_a_receive_posted_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    with _raw_pair(monkeypatch) as (t, peer, _):
        req = t.irecv(0, memoryview(bytearray(8)), _hdr(8))
        peer.shutdown(socket.SHUT_WR)  # OPEN, HEADER, a receive posted: end of stream
        with raises_comm(PeerLostError, peer=0, rank=1):
            req.wait(time.monotonic() + 10)
        assert t.peer_state(0) is PeerState.FAILED
        # FAILED: rank 1 told rank 0 why before it shut its side down.
        assert "lost the connection to rank 0" in _read_abort(peer)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("phase", ["header", "body"])
def test_state_reset_in_each_phase_is_peer_lost(monkeypatch: pytest.MonkeyPatch,
                                                phase: str) -> None:
    with _raw_pair(monkeypatch) as (t, peer, _):
        buf = bytearray(1000)
        req = t.irecv(0, memoryview(buf), _hdr(1000))
        if phase == "body":
            peer.sendall(_hdr(1000).pack() + b"x" * 300)
            _progress_until(t, lambda: _rx(t) is RxPhase.BODY)
        else:
            assert _rx(t) is RxPhase.HEADER
        _reset(peer)
        with raises_comm(PeerLostError, peer=0, rank=1):
            req.wait(time.monotonic() + 10)
        assert t.peer_state(0) is PeerState.FAILED
        with pytest.raises(PeerLostError):
            t.isend(0, memoryview(b""), _hdr(0))


@pytest.mark.timeout(30)
def test_state_stall_mid_frame_times_out_and_resumes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer that stops in the middle of a frame: the wait times out, the connection stays
    OPEN in BODY, and the frame completes once the rest arrives."""
    with _raw_pair(monkeypatch) as (t, peer, _):
        payload = bytes(range(256)) * 4
        buf = bytearray(len(payload))
        req = t.irecv(0, memoryview(buf), _hdr(len(payload)))
        peer.sendall(_hdr(len(payload)).pack() + payload[:100])
        _progress_until(t, lambda: _rx(t) is RxPhase.BODY)
        with raises_comm(CommTimeoutError, peer=0):
            req.wait(time.monotonic() + 0.05)
        assert t.failure is None and t.peer_state(0) is PeerState.OPEN
        assert _rx(t) is RxPhase.BODY and not req.done()
        peer.sendall(payload[100:])
        req.wait(time.monotonic() + 10)
        assert bytes(buf) == payload and _rx(t) is RxPhase.HEADER


@pytest.mark.timeout(30)
def test_state_held_header_completes_when_the_receive_is_posted(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A header that arrives before its receive is held (HELD), also for an empty frame."""
    with _raw_pair(monkeypatch) as (t, peer, _):
        peer.sendall(_hdr(0, seq=1).pack() + _hdr(3, seq=2).pack() + b"abc")
        _progress_until(t, lambda: _rx(t) is RxPhase.HELD)
        empty = t.irecv(0, memoryview(bytearray(0)), _hdr(0, seq=1))
        buf = bytearray(3)
        req = t.irecv(0, memoryview(buf), _hdr(3, seq=2))
        empty.wait(time.monotonic() + 10)
        req.wait(time.monotonic() + 10)
        assert bytes(buf) == b"abc" and _rx(t) is RxPhase.HEADER
        assert t.stats.snapshot()["messages_received"] == 2


@pytest.mark.timeout(30)
@pytest.mark.parametrize("phase", ["header", "held", "body"])
def test_state_local_abort_in_each_phase(monkeypatch: pytest.MonkeyPatch, phase: str) -> None:
    """abort() in every receive phase: the posted receive fails with the reason, the peer gets
    an ABORT frame, the connection is FAILED, and what the peer still sends is read and
    dropped (its large write completes)."""
    with _raw_pair(monkeypatch) as (t, peer, _):
        req = None
        if phase == "held":
            peer.sendall(_hdr(10).pack())
            _progress_until(t, lambda: _rx(t) is RxPhase.HELD)
        else:
            req = t.irecv(0, memoryview(bytearray(10)), _hdr(10))
            if phase == "body":
                peer.sendall(_hdr(10).pack() + b"12345")
                _progress_until(t, lambda: _rx(t) is RxPhase.BODY)
        t.abort("stop here")
        assert t.peer_state(0) is PeerState.FAILED
        if req is not None:
            with pytest.raises(CommError, match="rank 1 aborted: stop here"):
                req.wait(time.monotonic() + 10)
        assert _read_abort(peer) == "stop here"
        peer.settimeout(20)
        peer.sendall(b"\0" * (16 * MiB))  # completes only if rank 1 keeps reading
        assert peer.recv(1) == b""  # rank 1 shut its side down after the notice


@pytest.mark.timeout(30)
@pytest.mark.parametrize("phase", ["header", "held"])
def test_state_peer_abort_notice(monkeypatch: pytest.MonkeyPatch, phase: str) -> None:
    """An ABORT frame between frames fails the transport with the peer's reason, also when a
    data header is held before it."""
    with _raw_pair(monkeypatch) as (t, peer, _):
        if phase == "held":
            peer.sendall(_hdr(4, seq=1).pack() + b"data")
            _progress_until(t, lambda: _rx(t) is RxPhase.HELD)
            buf = bytearray(4)
            t.irecv(0, memoryview(buf), _hdr(4, seq=1)).wait(time.monotonic() + 10)
        req = t.irecv(0, memoryview(bytearray(8)), _hdr(8, seq=2))
        reason = "disk full"
        peer.sendall(FrameHeader(0, 0, 0, len(reason), kind=2).pack() + reason.encode())
        with pytest.raises(PeerLostError, match=r"^rank 0 aborted: disk full$"):
            req.wait(time.monotonic() + 10)
        assert t.peer_state(0) is PeerState.FAILED


@pytest.mark.timeout(30)
def test_state_peer_abort_mid_frame_reason_from_the_store(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer that aborts in the middle of a frame leaves its reason in the store and closes:
    the receive fails with that reason."""
    with _raw_pair(monkeypatch) as (t, peer, client):
        req = t.irecv(0, memoryview(bytearray(100)), _hdr(100))
        peer.sendall(_hdr(100).pack() + b"x" * 10)
        _progress_until(t, lambda: _rx(t) is RxPhase.BODY)
        client.set(_k(KEY_ABORT.format(0)), b"out of memory")
        peer.shutdown(socket.SHUT_WR)
        with pytest.raises(PeerLostError, match=r"^rank 0 aborted: out of memory$"):
            req.wait(time.monotonic() + 10)


# --------------------------------------------------------------------------------------------
# Socket helpers
# --------------------------------------------------------------------------------------------


def test_recv_exact_is_short_only_at_end_of_stream() -> None:
    a, b = socket.socketpair()
    with a, b:
        a.sendall(b"0123456789")
        buf = bytearray(4)
        assert netio.recv_exact(b, memoryview(buf)) == 4 and buf == b"0123"
        assert netio.recv_exact(b, memoryview(bytearray(0))) == 0
        a.shutdown(socket.SHUT_WR)
        rest = bytearray(10)
        assert netio.recv_exact(b, memoryview(rest)) == 6 and rest[:6] == b"456789"
        with pytest.raises(ConnectionError, match="after 0 of 3 bytes"):
            netio.recv_bytes(b, 3)


def test_send_all_parts_skips_what_was_sent() -> None:
    a, b = socket.socketpair()
    with a, b:
        parts: list[bytes | memoryview] = [b"head", memoryview(b"payload"), b"tag"]
        netio.send_all_parts(a, parts, sent=6)
        a.shutdown(socket.SHUT_WR)
        assert netio.recv_bytes(b, 8) == b"yloadtag"


def test_backoff_doubles_up_to_its_cap_and_stops_at_the_deadline() -> None:
    b = netio.Backoff(0.01, 0.03)
    assert [b.next() for _ in range(4)] == [0.01, 0.02, 0.03, 0.03]
    start = time.monotonic()
    netio.Backoff(60.0).sleep(start)  # the deadline has passed: no pause
    assert b.delay == 0.03


def test_world_size_mismatch_fails_every_rank_at_once() -> None:
    """Rank 1 was started with another world size than rank 0: it refuses at set-up and
    publishes its reason, so rank 0 raises PeerLostError naming rank 1 at once instead of
    waiting for its (long) deadline."""
    out = set_up_two(lambda r, port: TCPTransport.create(
        r, 2 if r == 0 else 3, "127.0.0.1", port, timeout=120.0, close_timeout=1.0))
    assert isinstance(out[1], UsageError) and "world size 3" in str(out[1]), out
    assert isinstance(out[0], PeerLostError) and out[0].peer == 1, out
    assert "refused" in str(out[0]) and "world size 3" in str(out[0])
