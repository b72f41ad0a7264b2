"""The TCP transport's frame checksum (CRC32C after every data frame, on by default): a bit
flipped on the wire is a ProtocolError naming the link on every rank; with
``BITCOLL_CHECKSUM=0`` it is delivered as it arrived (the documented old behaviour).

Two kinds of test: transports built by hand over a forwarder that flips one byte (every frame
path: plain receives, consumed receives, each part of a frame), and real ranks (separate
processes, ``bitcoll.init``) whose rank 0 has its connection to rank 1 routed through such a
forwarder inside its own process (its socket's descriptor is replaced with ``dup2``), so the
bytes that rank 1 reads are altered after rank 0's transport wrote them, as a faulty link
would alter them."""

from __future__ import annotations

import array
import contextlib
import fcntl
import os
import select
import socket
import termios
import threading
import time
from typing import Any

import numpy as np
import pytest
from errcheck import raises_usage
from multiproc import context, start, tcp_env
from tcp_world import free_port, set_up_two
from test_integrity import _DictStore

from bitcoll.errors import PeerLostError, ProtocolError, UsageError
from bitcoll.kernels.checksum import CHECKSUM_BYTES, frame_checksum
from bitcoll.transport.base import HEADER_SIZE, FrameHeader
from bitcoll.transport.tcp.transport import LATE_CHECKSUM_BYTES, TCPTransport, _Rendezvous

pytestmark = pytest.mark.tcp


def _forward(src: socket.socket, dst: socket.socket, flip: int | None) -> None:
    """Copy ``src`` to ``dst`` until either ends, xoring 0x01 into the byte at stream offset
    ``flip`` (None: faithfully); then shut ``dst``'s sending side."""
    pos = 0
    while True:
        try:
            data = bytearray(src.recv(1 << 16))
        except OSError:
            break
        if not data:
            break
        if flip is not None and pos <= flip < pos + len(data):
            data[flip - pos] ^= 0x01
        pos += len(data)
        try:
            dst.sendall(data)
        except OSError:
            break
    with contextlib.suppress(OSError):
        dst.shutdown(socket.SHUT_WR)


def _pair(flip_at: int | None, checksum: bool) -> tuple[TCPTransport, TCPTransport]:
    """Ranks 0 and 1 built by hand, their 0 -> 1 bytes through a forwarder flipping the byte
    at ``flip_at``."""
    a0, f0 = socket.socketpair()
    f1, b1 = socket.socketpair()
    threading.Thread(target=_forward, args=(f0, f1, flip_at), daemon=True).start()
    threading.Thread(target=_forward, args=(f1, f0, None), daemon=True).start()
    store = _DictStore()
    secret = b"k" * 32
    t0 = TCPTransport(0, 2, {1: a0}, _Rendezvous(store, "t/", secret, "test"), 7,
                      close_timeout=2.0, checksum=checksum)
    t1 = TCPTransport(1, 2, {0: b1}, _Rendezvous(store, "t/", secret, "test"), 7,
                      close_timeout=2.0, checksum=checksum)
    return t0, t1


N = 1000  # float32 elements of each frame in the tests below
#: Where the flip goes, in a frame of ``n`` float32 elements (first frame unless named).
FLIPS: dict[str, Any] = {
    "none": lambda n: None,
    "payload": lambda n: HEADER_SIZE + 5,
    "last-byte": lambda n: HEADER_SIZE + 4 * n - 1,
    "checksum": lambda n: HEADER_SIZE + 4 * n + 2,
    "second-frame": lambda n: HEADER_SIZE + 4 * n + CHECKSUM_BYTES + HEADER_SIZE + 7,
}


@pytest.mark.parametrize("n", [N, LATE_CHECKSUM_BYTES // 4 + 25_003], ids=["small", "late"])
@pytest.mark.parametrize("consume", [False, True], ids=["irecv", "consume"])
@pytest.mark.parametrize("where", list(FLIPS))
def test_a_flipped_bit_fails_the_receive_naming_the_link(where: str, consume: bool,
                                                         n: int) -> None:
    """Two frames 0 -> 1; a flip in a payload or a checksum fails rank 1 with ProtocolError
    naming the link and the frame, rank 0 with the abort it is sent; none: both frames
    arrive intact and the counters include the checksums. Small frames carry a checksum
    computed before the send; large ones (from LATE_CHECKSUM_BYTES up) one computed
    while the payload drains, and are received in many pieces, each checksummed as it
    arrives."""
    flip = FLIPS[where](n)
    frame = HEADER_SIZE + 4 * n + CHECKSUM_BYTES
    t0, t1 = _pair(flip, True)
    payloads = [np.arange(n, dtype=np.float32) + k for k in range(2)]
    try:
        for seq, payload in enumerate(payloads, 1):
            header = FrameHeader(seq=seq, step=0, signature=9, length=payload.nbytes)
            got = np.zeros_like(payload)
            view = got.view(np.uint8)
            if consume:
                def sink(offset: int, chunk: memoryview, view: Any = view) -> None:
                    view[offset:offset + len(chunk)] = np.frombuffer(chunk, np.uint8)

                recv = t1.irecv_consume(0, payload.nbytes, header, sink)
            else:
                recv = t1.irecv(0, view.data, header)
            t0.isend(1, payload.view(np.uint8).data, header)
            deadline = time.monotonic() + 20
            if flip is None or flip >= frame * seq:
                recv.wait(deadline)
                np.testing.assert_array_equal(got, payload)
                continue
            with pytest.raises(ProtocolError) as info:
                recv.wait(deadline)
            msg = str(info.value)
            assert "failed its checksum" in msg and "link from rank 0 to rank 1" in msg, msg
            assert f"collective #{seq}" in msg and info.value.peer == 0, msg
            # Rank 0 learns it through the abort notice rank 1 sends it.
            with pytest.raises(PeerLostError, match=r"rank 1 aborted: .*failed its checksum"):
                t0.irecv(1, np.zeros(1, np.uint8).data, FrameHeader(99, 0, 9, 1)).wait(
                    time.monotonic() + 20)
            return
        assert flip is None
        sent, got_stats = t0.stats.snapshot(), t1.stats.snapshot()
        assert sent["bytes_sent"] == got_stats["bytes_received"] == 2 * frame
        assert sent["messages_sent"] == got_stats["messages_received"] == 2
    finally:
        t0.close()
        t1.close()


def _unread(sock: socket.socket) -> int:
    """Bytes waiting in ``sock``'s receive queue (FIONREAD)."""
    out = array.array("i", [0])
    fcntl.ioctl(sock.fileno(), termios.FIONREAD, out)
    return out[0]


def _raw_to(checksum: bool = True) -> tuple[socket.socket, TCPTransport]:
    """Rank 1 built by hand and the raw socket of rank 0's side: the test writes rank 0's
    bytes itself."""
    a0, b1 = socket.socketpair()
    t1 = TCPTransport(1, 2, {0: b1}, _Rendezvous(_DictStore(), "t/", b"k" * 32, "test"), 7,
                      close_timeout=2.0, checksum=checksum)
    return a0, t1


SMALL = 24  # payload bytes of the frames cut at every position


@pytest.mark.parametrize("consume", [False, True], ids=["irecv", "consume"])
@pytest.mark.parametrize("bad", [False, True], ids=["intact", "altered"])
def test_a_frame_cut_anywhere_is_delivered_or_refused_whole(consume: bool, bad: bool) -> None:
    """A frame that arrives in two pieces, cut after every byte of its header, payload and
    checksum (the receiver reads the first piece before the second is written): intact, it
    is delivered whole; with its last checksum byte altered, it fails with ProtocolError.
    The receiver reads a payload's end and its checksum in one call where both are there, so
    every split of the trailer between two reads is covered."""
    payload = bytes(range(100, 100 + SMALL))
    for cut in range(1, HEADER_SIZE + SMALL + CHECKSUM_BYTES):
        a0, t1 = _raw_to()
        try:
            header = FrameHeader(seq=1, step=0, signature=9, length=SMALL)
            head = header.pack()
            tail = bytearray(frame_checksum(head, memoryview(payload)))
            if bad:
                tail[-1] ^= 0x01
            frame = head + payload + bytes(tail)
            got = bytearray(SMALL)
            if consume:
                def sink(offset: int, chunk: memoryview, got: bytearray = got) -> None:
                    got[offset:offset + len(chunk)] = chunk

                recv = t1.irecv_consume(0, SMALL, header, sink)
            else:
                recv = t1.irecv(0, memoryview(got), header)
            a0.sendall(frame[:cut])
            end = time.monotonic() + 20
            while _unread(t1._peers[0].sock):  # rank 1 has read the first piece
                assert time.monotonic() < end, f"cut {cut}: the first piece was never read"
                t1.progress()
                select.select([], [], [], 0.001)
            assert not recv.done(), f"cut {cut}: done before its last bytes"
            a0.sendall(frame[cut:])
            if bad:
                with pytest.raises(ProtocolError, match="failed its checksum"):
                    recv.wait(time.monotonic() + 20)
                continue
            recv.wait(time.monotonic() + 20)
            assert bytes(got) == payload, f"cut {cut}"
            assert t1.stats.snapshot()["bytes_received"] == len(frame)
        finally:
            t1.close()
            a0.close()


def test_an_abort_reason_longer_than_the_posted_receive_is_read_whole() -> None:
    """An abort notice whose reason runs past the posted receive's buffer (the bytes after
    it land where a checksum would): the reason is reported whole."""
    a0, t1 = _raw_to()
    try:
        recv = t1.irecv(0, memoryview(bytearray(8)), FrameHeader(1, 0, 9, 8))
        reason = "the reason runs well past eight bytes"
        a0.sendall(FrameHeader(0, 0, 0, len(reason), kind=2).pack() + reason.encode())
        with pytest.raises(PeerLostError) as info:
            recv.wait(time.monotonic() + 20)
        assert str(info.value) == f"rank 0 aborted: {reason}"
    finally:
        t1.close()
        a0.close()


def test_without_the_checksum_a_flipped_bit_is_delivered() -> None:
    """``checksum=False``: the frames carry nothing more and the altered payload is
    delivered as it arrived (the behaviour the documentation warns of)."""
    t0, t1 = _pair(HEADER_SIZE + 5, False)
    payload = np.arange(N, dtype=np.float32)
    header = FrameHeader(seq=1, step=0, signature=9, length=payload.nbytes)
    got = np.zeros_like(payload)
    try:
        recv = t1.irecv(0, got.view(np.uint8).data, header)
        t0.isend(1, payload.view(np.uint8).data, header)
        recv.wait(time.monotonic() + 20)
        assert t1.failure is None
        assert got.tobytes() != payload.tobytes()
        assert (got != payload).sum() == 1  # element 1: one flipped bit
        assert t1.stats.snapshot()["bytes_received"] == HEADER_SIZE + payload.nbytes
    finally:
        t0.close()
        t1.close()


def test_checksum_must_match_across_ranks() -> None:
    """Rank 0 with the checksum, rank 1 without (two threads): rank 1 refuses at set-up and
    names the setting; rank 0 fails at once with its reason."""
    out = set_up_two(lambda r, port: TCPTransport.create(
        r, 2, "127.0.0.1", port, timeout=10.0, checksum=r == 0, close_timeout=1.0), join=30)
    assert isinstance(out[1], UsageError) and "checksum=False" in str(out[1]), out
    assert isinstance(out[0], PeerLostError) and "checksum" in str(out[0]), out


def test_bad_variable_is_a_usage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BITCOLL_CHECKSUM", "yes")
    with raises_usage("BITCOLL_CHECKSUM"):
        TCPTransport.create(0, 1, "127.0.0.1", 1)


# --------------------------------------------------------------------------------------------
# Real ranks
# --------------------------------------------------------------------------------------------


def _corrupt_link(t: TCPTransport, peer: int, flip_at: int) -> None:
    """Route this rank's connection to ``peer`` through a forwarder in this process that
    flips the byte at offset ``flip_at`` of what this rank sends from now on."""
    p = t._peers[peer]
    real = socket.socket(fileno=os.dup(p.fd))
    inner, outer = socket.socketpair()
    inner.setblocking(p.sock.getblocking())
    os.dup2(inner.fileno(), p.fd)  # the transport's descriptor is now the pair's end
    inner.close()
    threading.Thread(target=_forward, args=(outer, real, flip_at), daemon=True).start()
    threading.Thread(target=_forward, args=(real, outer, None), daemon=True).start()


def _rank(q: Any, rank: int, size: int, port: int, n: int, flip_at: int | None,
          env: dict[str, str]) -> None:
    """One rank: ``bitcoll.init`` (no shared memory), rank 0 corrupts its link to rank 1,
    then a sum all-reduce of ``n`` float32; reports (rank, error type, message, whether the
    result is right) and re-raises, so the process exits non-zero on an error."""
    os.environ.update(tcp_env(rank, size, port))
    os.environ.update(env)
    os.environ["NUMBA_NUM_THREADS"] = "1"
    import bitcoll

    comm = bitcoll.init("tcp", timeout=60.0, shm=False)
    try:
        transport = comm.transport
        assert isinstance(transport, TCPTransport)
        if rank == 0 and flip_at is not None:
            _corrupt_link(transport, 1, flip_at)
        streamed: list[bool] = []
        plain_stream = transport.stream

        def stream(*args: Any) -> bool:
            streamed.append(True)
            return plain_stream(*args)

        transport.stream = stream  # type: ignore[method-assign,assignment]
        x = (np.arange(n) % 1000 + rank).astype(np.float32)
        want = (np.arange(n) % 1000 * size + size * (size - 1) // 2).astype(np.float32)
        y = comm.allreduce(x, op="sum")
        # A rank whose part of the all-reduce was complete learns of the failure at its next
        # call (here: the next step's collective).
        comm.barrier()
        q.put((rank, None, "", bool(np.array_equal(y, want)), bool(streamed)))
    except BaseException as exc:
        q.put((rank, type(exc).__name__, str(exc), False, bool(streamed)))
        raise
    finally:
        comm.close()


def _world(size: int, n: int, flip_at: int | None,
           env: dict[str, str]
           ) -> tuple[dict[int, tuple[str | None, str, bool, bool]], list[int]]:
    port = free_port()
    q = context(__name__).Queue()
    procs = [start(_rank, q, r, size, port, n, flip_at, env) for r in range(size)]
    results: dict[int, tuple[str | None, str, bool, bool]] = {}
    try:
        for _ in range(size):
            rank, etype, msg, right, streamed = q.get(timeout=120)
            results[rank] = (etype, msg, right, streamed)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join()
    return results, [p.exitcode for p in procs]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("size", "n"), [(2, 100_003), (3, 1001), (3, 1_000_003)])
def test_real_ranks_fail_naming_the_link(size: int, n: int) -> None:
    """A byte flipped on the link 0 -> 1 during an all-reduce (small: the frame path; large:
    the streamed ring), then a barrier: every rank fails with an error naming the checksum
    and the link (rank 1 at once; a rank whose part was complete at its next call), and every
    process exits non-zero."""
    results, codes = _world(size, n, HEADER_SIZE + 4 * min(n // size, 4000) // 2, {})
    for rank, (etype, msg, _, _) in results.items():
        assert etype in ("ProtocolError", "PeerLostError"), (rank, results)
        assert "failed its checksum" in msg and "link from rank 0 to rank 1" in msg, \
            (rank, results)
    assert results[1][0] == "ProtocolError", results
    if n > 500_000:  # the streamed ring: the kernel checks the checksum
        assert results[1][3], results
    assert all(c not in (0, None) for c in codes), codes


@pytest.mark.timeout(300)
def test_real_ranks_without_the_checksum_go_on_silently() -> None:
    """``BITCOLL_CHECKSUM=0``: the same flip gives a wrong result and exit code 0 (what the
    checksum exists to prevent)."""
    results, codes = _world(3, 1001, HEADER_SIZE + 5, {"BITCOLL_CHECKSUM": "0"})
    assert all(etype is None for etype, _, _, _ in results.values()), results
    assert not all(right for _, _, right, _ in results.values()), results
    assert codes == [0, 0, 0], codes


def _setting(comm: Any) -> bool:
    transport = comm.transport
    assert isinstance(transport, TCPTransport)
    y = comm.allreduce(np.arange(10, dtype=np.float32))
    assert np.array_equal(y, 2 * np.arange(10, dtype=np.float32))
    return bool(transport.checksum)


@pytest.mark.timeout(120)
def test_init_switch() -> None:
    """``bitcoll.init(checksum=...)`` over ``BITCOLL_CHECKSUM``; on by default; a non-TCP
    backend refuses ``checksum=True``."""
    from multiproc import run_world

    import bitcoll

    assert run_world(2, _setting, shm=False) == [True, True]
    assert run_world(2, _setting, shm=False, checksum=False) == [False, False]
    assert run_world(2, _setting, shm=False,
                     rank_env={0: {"BITCOLL_CHECKSUM": "0"}, 1: {"BITCOLL_CHECKSUM": "0"}}
                     ) == [False, False]
    with raises_usage("checksum"):
        bitcoll.init("local", checksum=True)
