"""The TCP transport's streams (``TCPTransport.stream``, run by :mod:`bitcoll.kernels.stream`):
rank 1's real transport against a raw socket playing rank 0, so that every frame on the wire,
every state a stream can meet and every way it can end is set up exactly (the raw side writes
its frames before the stream starts, or from a thread the test releases with an event)."""

from __future__ import annotations

import itertools
import os
import select
import socket
import threading
import time
import types
from typing import Any

import numpy as np
import pytest
from errcheck import raises_comm
from test_tcp_transport import (
    SIG,
    _hdr,
    _k,
    _progress_until,
    _raw_pair,
    _read_abort,
    _reset,
    _rx,
    _until_inside,
)

from bitcoll.errors import CommTimeoutError, PeerLostError, ProtocolError
from bitcoll.kernels import stream as stream_kernel
from bitcoll.transport.base import HEADER_SIZE, FrameHeader, StreamPlan
from bitcoll.transport.tcp.transport import KEY_ABORT, PeerState, RxPhase, TCPTransport

pytestmark = [pytest.mark.tcp, pytest.mark.skipif(not stream_kernel.AVAILABLE,
                                                  reason="streams need Linux, little-endian")]

LAND = stream_kernel.MODE_LAND
FOLD = stream_kernel.MODE_FOLD
DIVIDE = stream_kernel.MODE_FOLD_DIVIDE


def _h(step: int, nbytes: int, seq: int = 5) -> FrameHeader:
    return FrameHeader(seq=seq, step=step, signature=SIG, length=nbytes)


def _plan(work: np.ndarray, src: np.ndarray, op: str, divisor: int,
          sends: list[tuple[int, int, bool, int]],
          recvs: list[tuple[int, int, int]]) -> StreamPlan:
    """Steps 0, 1, ... in each direction, as ``OpContext.stream`` numbers them."""
    size = work.itemsize
    return StreamPlan(work, src, op, divisor,
                      [(_h(i, (z - a) * size), a, z, f, after)
                       for i, (a, z, f, after) in enumerate(sends)],
                      [(_h(j, (z - a) * size), a, z, m) for j, (a, z, m) in enumerate(recvs)])


def _recv_all(peer: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    got = 0
    while got < n:
        k = peer.recv_into(memoryview(buf)[got:], n - got)
        assert k, "the connection ended"
        got += k
    return bytes(buf)


def _read_frames(peer: socket.socket, lengths: list[int]) -> list[tuple[FrameHeader, bytes]]:
    peer.settimeout(10)
    return [(FrameHeader.unpack(_recv_all(peer, HEADER_SIZE)), _recv_all(peer, n))
            for n in lengths]


def _frame(step: int, arr: np.ndarray) -> bytes:
    return _h(step, arr.nbytes).pack() + arr.tobytes()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", ["float32", "float64", "int32", "uint8", "int64"])
@pytest.mark.parametrize("op", ["sum", "avg", "max", "min"])
def test_stream_folds_lands_and_forwards(monkeypatch: pytest.MonkeyPatch, dtype: str,
                                         op: str) -> None:
    """The frames of a two-rank ring all-reduce (block 1 sent from ``src``, block 0 folded
    and forwarded, block 1 landed): exactly the frames the frame path writes, the folds of
    numpy, and one message per frame in the counters. Sizes cross the fold's piece size and
    include an empty segment."""
    if op == "avg" and dtype[0] != "f":
        pytest.skip("avg is for floating dtypes")
    rng = np.random.default_rng(7)
    dt = np.dtype(dtype)
    piece = stream_kernel_piece(dt)
    n0, n1 = 3 * piece + 5, piece + 1  # blocks: 0 (this rank folds it), 1 (the peer's)
    src = rng.integers(0, 100, n0 + n1).astype(dt)
    peer_src = rng.integers(0, 100, n0 + n1).astype(dt)
    work = np.zeros_like(src)
    segs0 = [(0, 2 * piece), (2 * piece, n0), (n0, n0)]  # the last one empty
    segs1 = [(n0, n0 + n1)]
    ufunc = {"sum": np.add, "avg": np.add, "max": np.maximum, "min": np.minimum}[op]
    folded = ufunc(src[:n0], peer_src[:n0])
    if op == "avg":
        folded = (folded / dt.type(2)).astype(dt)
    final1 = ufunc(src[n0:], peer_src[n0:])
    mode = DIVIDE if op == "avg" else FOLD
    sends = [(a, z, True, -1) for a, z in segs1]
    sends += [(a, z, False, j) for j, (a, z) in enumerate(segs0)]
    recvs = [(a, z, mode) for a, z in segs0] + [(a, z, LAND) for a, z in segs1]
    with _raw_pair(monkeypatch) as (t, peer, _):
        # Rank 0's frames: its block 0 (to fold), then the final block 1 (to land).
        peer.sendall(b"".join(_frame(j, peer_src[a:z]) for j, (a, z) in enumerate(segs0))
                     + _frame(len(segs0), final1))
        plan = _plan(work, src, "sum" if op == "avg" else op, 2, sends, recvs)
        got: dict[str, Any] = {}
        reader = threading.Thread(target=lambda: got.update(
            frames=_read_frames(peer, [(z - a) * dt.itemsize for a, z, _, _ in sends])))
        reader.start()
        assert t.stream(0, 0, plan, time.monotonic() + 30)
        reader.join(30)
        assert np.array_equal(work[:n0], folded)
        assert np.array_equal(work[n0:], final1)
        frames = got["frames"]
        assert [h for h, _ in frames] == [_h(i, (z - a) * dt.itemsize)
                                          for i, (a, z, _, _) in enumerate(sends)]
        assert frames[0][1] == src[n0:].tobytes()
        assert b"".join(b for _, b in frames[1:]) == folded.tobytes()
        stats = t.stats.snapshot()
        assert stats["messages_sent"] == len(sends) and stats["messages_received"] == len(recvs)
        assert stats["bytes_sent"] == len(sends) * HEADER_SIZE + src.nbytes
        assert _rx(t) is RxPhase.HEADER and t.failure is None


def stream_kernel_piece(dt: np.dtype[Any]) -> int:
    """Elements of one fold piece (the per-peer bounce buffer)."""
    from bitcoll.transport.tcp.transport import CONSUME_CHUNK_BYTES
    return CONSUME_CHUNK_BYTES // dt.itemsize


def _one_recv(n: int = 1000) -> tuple[np.ndarray, StreamPlan]:
    work = np.zeros(n, np.float32)
    return work, _plan(work, work, "sum", 2, [], [(0, n, LAND)])


@pytest.mark.timeout(30)
def test_stream_uses_a_header_read_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first frame's header already read while the rank waited elsewhere (HELD)."""
    with _raw_pair(monkeypatch) as (t, peer, _):
        data = np.arange(1000, dtype=np.float32)
        peer.sendall(_h(0, data.nbytes).pack())
        _progress_until(t, lambda: _rx(t) is RxPhase.HELD)
        peer.sendall(data.tobytes())
        work, plan = _one_recv()
        assert t.stream(0, 0, plan, time.monotonic() + 10)
        assert np.array_equal(work, data) and _rx(t) is RxPhase.HEADER


@pytest.mark.timeout(30)
@pytest.mark.parametrize("n", [1000, (256 << 10) // 4 + 1])
def test_small_streams_look_before_they_block(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    """A stream that receives at most HELPER_RECEIVE_BYTES first looks for its frame without
    blocking (poll timeouts of 0, yielding between looks), then blocks; a larger one blocks
    at once, as does any stream on an oversubscribed host. Either way the frame, sent in two
    parts around the first block, lands whole."""
    calls: list[int] = []
    blocked = threading.Event()
    run = stream_kernel.run_stream_checked

    def counting(*args: Any) -> int:
        calls.append(args[21])  # timeout_ms
        if args[21] > 0:
            blocked.set()
        return int(run(*args))

    monkeypatch.setattr(stream_kernel, "run_stream_checked", counting)
    with _raw_pair(monkeypatch) as (t, peer, _):
        t.oversubscribed = False  # (this host's ranks fit its cores)
        data = np.arange(n, dtype=np.float32)
        frame = _frame(0, data)
        work, plan = _one_recv(n)

        def send() -> None:
            peer.sendall(frame[:HEADER_SIZE + 8])
            blocked.wait(10)  # the stream blocked in poll: the rest wakes it
            peer.sendall(frame[HEADER_SIZE + 8:])

        sender = threading.Thread(target=send)
        sender.start()
        assert t.stream(0, 0, plan, time.monotonic() + 10)
        sender.join(10)
        assert np.array_equal(work, data) and _rx(t) is RxPhase.HEADER
        assert blocked.is_set()
        if n * 4 <= (256 << 10):
            assert calls[0] == 0
        else:
            assert 0 not in calls
        calls.clear()
        blocked.clear()
        t.oversubscribed = True
        work, plan = _one_recv(n)
        sender = threading.Thread(target=send)
        sender.start()
        assert t.stream(0, 0, plan, time.monotonic() + 10)
        sender.join(10)
        assert np.array_equal(work, data) and 0 not in calls


class _CountingPoll:
    """``select.poll()`` whose ``poll`` calls are recorded (their timeouts), and which sets
    ``blocked`` on the first one that may block."""

    def __init__(self, timeouts: list[int], blocked: threading.Event) -> None:
        self._p = select.poll()
        self._timeouts = timeouts
        self._blocked = blocked

    def register(self, fd: int, mask: int) -> None:
        self._p.register(fd, mask)

    def unregister(self, fd: int) -> None:
        self._p.unregister(fd)

    def poll(self, timeout: int) -> list[tuple[int, int]]:
        self._timeouts.append(timeout)
        if timeout:
            self._blocked.set()
        return self._p.poll(timeout)


@pytest.mark.timeout(30)
def test_frame_waits_on_an_oversubscribed_host_block_at_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Waiting for a frame, a rank whose host runs more ranks than it has cores looks once
    and then blocks in poll (no spin that would keep the awaited rank off the core); the
    frame, sent once it blocked, completes the receive."""
    from bitcoll.transport.tcp import transport as tcp_module

    timeouts: list[int] = []
    blocked = threading.Event()
    monkeypatch.setattr(tcp_module, "select", types.SimpleNamespace(
        poll=lambda: _CountingPoll(timeouts, blocked)))  # this transport's polls only
    with _raw_pair(monkeypatch) as (t, peer, _):
        t.oversubscribed = True
        data = np.arange(10, dtype=np.float32)
        buf = np.zeros(10, np.float32)
        req = t.irecv(0, buf.data, _h(0, data.nbytes))

        def send() -> None:
            blocked.wait(10)
            peer.sendall(_frame(0, data))

        sender = threading.Thread(target=send)
        sender.start()
        req.wait(time.monotonic() + 10)
        sender.join(10)
        assert np.array_equal(buf, data) and blocked.is_set()
        # every look that found nothing was followed by a block, never by another look
        assert all(not (a == 0 and b == 0) for a, b in itertools.pairwise(timeouts))


@pytest.mark.timeout(30)
def test_stream_folds_what_the_kernel_computes_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    """The TCP stream folds what its native kernel computes as numpy would: sums of every
    dtype but float16, max and min of integers only (numpy's NaN rules for floats)."""
    with _raw_pair(monkeypatch) as (t, _, _):
        for dt in ("float32", "float64", "int8", "uint64"):
            assert t.stream_folds(np.dtype(dt), "sum")
        assert not t.stream_folds(np.dtype("float16"), "sum")
        assert t.stream_folds(np.dtype("int32"), "max") and t.stream_folds(np.dtype("uint8"), "min")
        assert not t.stream_folds(np.dtype("float32"), "max")
        assert not t.stream_folds(np.dtype("float64"), "min")


@pytest.mark.timeout(30)
def test_stream_declines_when_the_connection_is_busy(monkeypatch: pytest.MonkeyPatch) -> None:
    """A receive posted from the peer, or a read-ahead header that is not the plan's first:
    False, nothing read or written, and the frame path goes on as if nothing happened."""
    with _raw_pair(monkeypatch) as (t, peer, _):
        buf = bytearray(8)
        req = t.irecv(0, memoryview(buf), _hdr(8, seq=9))
        _, plan = _one_recv()
        assert not t.stream(0, 0, plan, time.monotonic() + 10)
        peer.sendall(_hdr(8, seq=9).pack() + b"12345678")
        req.wait(time.monotonic() + 10)
        assert bytes(buf) == b"12345678"
        peer.sendall(_h(3, 4000).pack())  # not the plan's first header (step 3, not 0)
        _progress_until(t, lambda: _rx(t) is RxPhase.HELD)
        assert not t.stream(0, 0, plan, time.monotonic() + 10)
        assert t.failure is None and t.stats.snapshot()["messages_sent"] == 0


@pytest.mark.timeout(30)
def test_stream_header_mismatch_is_protocol_error(monkeypatch: pytest.MonkeyPatch) -> None:
    with _raw_pair(monkeypatch) as (t, peer, _):
        peer.sendall(_h(0, 4000, seq=6).pack() + bytes(4000))  # another collective's frame
        _, plan = _one_recv()
        with raises_comm(ProtocolError, peer=0, sequence=5) as info:
            t.stream(0, 0, plan, time.monotonic() + 10)
        assert t.peer_state(0) is PeerState.FAILED and t.failure is info.value
        assert "rank 0" in _read_abort(peer)


@pytest.mark.timeout(30)
def test_stream_garbage_is_protocol_error(monkeypatch: pytest.MonkeyPatch) -> None:
    with _raw_pair(monkeypatch) as (t, peer, _):
        peer.sendall(b"\xff" * HEADER_SIZE)
        _, plan = _one_recv()
        with pytest.raises(ProtocolError, match="bad frame magic"):
            t.stream(0, 0, plan, time.monotonic() + 10)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("where", ["between frames", "after a frame"])
def test_stream_peer_abort_notice(monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    with _raw_pair(monkeypatch) as (t, peer, _):
        work = np.zeros(2000, np.float32)
        plan = _plan(work, work, "sum", 2, [], [(0, 1000, LAND), (1000, 2000, LAND)])
        if where == "after a frame":
            peer.sendall(_frame(0, np.ones(1000, np.float32)))
        reason = "disk full"
        peer.sendall(FrameHeader(0, 0, 0, len(reason), kind=2).pack() + reason.encode())
        with pytest.raises(PeerLostError, match=r"^rank 0 aborted: disk full$"):
            t.stream(0, 0, plan, time.monotonic() + 10)
        assert t.peer_state(0) is PeerState.FAILED
        assert t.stats.snapshot()["messages_received"] == (where == "after a frame")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("how", ["end of stream", "reset"])
def test_stream_peer_lost_mid_frame(monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    """The peer goes away in the middle of a frame, with its abort reason in the store (end
    of stream) or without one (reset)."""
    with _raw_pair(monkeypatch) as (t, peer, client):
        peer.sendall(_h(0, 4000).pack() + bytes(100))
        _, plan = _one_recv()
        if how == "reset":
            _reset(peer)
            match = "rank 0"
        else:
            client.set(_k(KEY_ABORT.format(0)), b"out of memory")
            peer.shutdown(socket.SHUT_WR)
            match = r"^rank 0 aborted: out of memory$"
        with pytest.raises(PeerLostError, match=match):
            t.stream(0, 0, plan, time.monotonic() + 10)
        assert t.peer_state(0) is PeerState.FAILED


@pytest.mark.timeout(30)
def test_stream_send_to_a_peer_that_reset_is_peer_lost(monkeypatch: pytest.MonkeyPatch) -> None:
    """A large send the peer never reads, then the peer resets: the send side fails."""
    with _raw_pair(monkeypatch) as (t, peer, _):
        work = np.zeros(64 << 20, np.uint8)  # more than the socket buffers hold
        plan = _plan(work, work, "sum", 2, [(0, work.size, False, -1)], [])
        th, box = _stream_in_thread(t, plan, 20)
        assert select.select([peer], [], [], 10)[0]  # its bytes have arrived
        _reset(peer)  # the send is under way and cannot have finished (nothing is read)
        th.join(20)
        assert isinstance(box.get("err"), PeerLostError) and "rank 0" in str(box["err"])
        assert t.peer_state(0) is PeerState.FAILED


@pytest.mark.timeout(30)
def test_stream_stall_times_out_and_fails_the_transport(monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer that stops in the middle of a frame: CommTimeoutError at the deadline naming the
    receive, and the transport fails (a stream cannot be resumed)."""
    with _raw_pair(monkeypatch) as (t, peer, _):
        peer.sendall(_h(0, 4000).pack() + bytes(100))
        _, plan = _one_recv()
        start = time.monotonic()
        with pytest.raises(CommTimeoutError, match=r"receive from rank 0 \(collective #5, "
                                                   r"step 0, 4000 bytes\)") as info:
            t.stream(0, 0, plan, start + 0.3)
        assert time.monotonic() - start >= 0.3
        assert info.value.peer == 0 and t.failure is info.value
        assert t.peer_state(0) is PeerState.FAILED


@pytest.mark.timeout(30)
def test_stream_local_abort_from_another_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """abort() while a stream waits: the stream ends at once with the abort's error."""
    with _raw_pair(monkeypatch) as (t, peer, _):
        _, plan = _one_recv()
        th, box = _stream_in_thread(t, plan, 60)
        t.abort("stop here")
        th.join(10)
        assert not th.is_alive()
        assert "rank 1 aborted: stop here" in str(box["err"])
        assert _read_abort(peer) == "stop here"


def _stream_in_thread(t: TCPTransport, plan: StreamPlan, seconds: float
                      ) -> tuple[threading.Thread, dict[str, BaseException]]:
    """Start ``t.stream(0, 0, plan)`` (deadline ``seconds`` away) in a thread that leaves its
    error in the box under ``"err"``; return once the stream holds the connection."""
    box: dict[str, BaseException] = {}

    def run() -> None:
        try:
            t.stream(0, 0, plan, time.monotonic() + seconds)
        except BaseException as exc:
            box["err"] = exc

    th = threading.Thread(target=run)
    th.start()
    _until_inside(th, "_run_stream")  # holding the connection
    return th, box


def test_stream_kernel_reports_wake_watch_and_idle() -> None:
    """The kernel alone: a readable wake descriptor, a readable watched descriptor, and a poll
    that times out each end a call with their status, progress kept in ``state``."""
    a, b = socket.socketpair()
    w_r, w_w = os.pipe()
    x_r, x_w = os.pipe()
    try:
        a.setblocking(False)
        work = np.zeros(10, np.float32)
        head = np.frombuffer(_h(0, work.nbytes).pack(), np.uint8).reshape(1, HEADER_SIZE)
        empty = np.zeros(0, np.int64)
        args: list[Any] = [work, work, 0, np.float32(1), a.fileno(), a.fileno(), w_r, None,
                           np.zeros((0, HEADER_SIZE), np.uint8), empty, empty, empty, empty,
                           head, np.zeros(1, np.int64), np.array([10]), np.array([LAND]),
                           np.zeros(16, np.float32), np.zeros(HEADER_SIZE, np.uint8)]
        state = np.zeros(stream_kernel.STATE_SIZE, np.int64)

        def call(watch: list[int]) -> int:
            args[7] = np.array(watch, np.int32)
            run: Any = stream_kernel.run_stream
            return int(run(*args, np.zeros(2 * (3 + len(watch)), np.int32), state, 20))

        assert call([x_r]) == stream_kernel.Status.IDLE
        b.sendall(head.tobytes() + work.tobytes()[:8])
        assert call([x_r]) == stream_kernel.Status.IDLE and state[3] == HEADER_SIZE + 8
        os.write(x_w, b"!")
        assert call([x_r]) == stream_kernel.Status.WATCH
        os.write(w_w, b"!")
        assert call([]) == stream_kernel.Status.WAKE
        os.read(w_r, 1)
        b.sendall(np.arange(10, dtype=np.float32).tobytes()[8:])
        assert call([]) == stream_kernel.Status.DONE
        assert np.array_equal(work[2:], np.arange(2, 10, dtype=np.float32))
    finally:
        for fd in (w_r, w_w, x_r, x_w):
            os.close(fd)
        a.close()
        b.close()
