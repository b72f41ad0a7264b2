"""Shared memory between the ranks of one host (bitcoll.transport.shm / hybrid).

In-process tests build pairs of transports in threads (fast); multi-process tests use real
ranks (tests/multiproc.py run_world puts every rank on this host; GROUP_RANK fakes hosts).
"""

from __future__ import annotations

import glob
import os
import select
import signal
import stat
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import tcp_world
from errcheck import raises_comm, raises_usage
from multiproc import context, free_port, run_world, start, tcp_env
from sweeps import dense_sweep, inplace_and_async, packed_bandwidth, packed_sweep

import bitcoll
from bitcoll import topology as topology_mod
from bitcoll.communicator import Communicator
from bitcoll.errors import CommError, CommTimeoutError, PeerLostError, ProtocolError
from bitcoll.transport import peer as peer_mod
from bitcoll.transport.base import HEADER_SIZE, FrameHeader, Transport
from bitcoll.transport.peer import FrameRequest, PeerState
from bitcoll.transport.shm import channel as shm
from bitcoll.transport.shm.hybrid import HybridTransport, shm_enabled
from bitcoll.transport.tcp import TCPTransport

pytestmark = pytest.mark.skipif(not shm.supported(), reason="no shared memory rings here")


def _leftovers(job_id: int) -> list[str]:
    return glob.glob(os.path.join(shm.SHM_DIR, f"bitcoll-shm-{job_id:016x}-*"))


# ------------------------------------------------------------------ in-process worlds


def _thread_world(size: int, hosts: Sequence[int] | None = None,
                  ring_bytes: int | None = None, single_copy: bool = True,
                  single_copy_min_bytes: int = shm.SINGLE_COPY_MIN_BYTES) -> list[Transport]:
    """``size`` transports built in threads of this process (TCP, then the shared memory
    set-up, both collective; the single-copy settings are HybridTransport.create's)."""
    port = free_port()
    out: dict[int, Transport | BaseException] = {}

    def rank(r: int) -> None:
        try:
            t = TCPTransport.create(r, size, "127.0.0.1", port, timeout=20, close_timeout=5)
            out[r] = HybridTransport.create(t, hosts or [0] * size, 20, ring_bytes,
                                            single_copy, single_copy_min_bytes)
        except BaseException as exc:
            out[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    got = [out[r] for r in range(size)]
    for g in got:
        if isinstance(g, BaseException):
            raise g
    return got  # type: ignore[return-value]


def _close(ts: Sequence[Transport]) -> None:
    closers = [threading.Thread(target=t.close) for t in ts]
    for c in closers:
        c.start()
    for c in closers:
        c.join(30)


def _h(step: int, n: int, seq: int = 7) -> FrameHeader:
    return FrameHeader(seq=seq, step=step, signature=99, length=n)


SIZES = (0, 1, 7, 8, 31, 4096, 8191, 100_000, (1 << 20) + 3)


@pytest.mark.parametrize("single_copy", [False, True])
def test_frames_wrap_the_ring_and_counters_are_exact(single_copy: bool) -> None:
    """Frames smaller and larger than an 8 KiB ring, both directions, irecv and
    irecv_consume, through the ring or by single copy from 4 KiB up; payloads exact,
    consumer pieces aligned, byte counters exact."""
    t0, t1 = _thread_world(2, ring_bytes=8192, single_copy=single_copy,
                           single_copy_min_bytes=4096)
    try:
        assert isinstance(t0, HybridTransport) and isinstance(t1, HybridTransport)
        assert t0.shm_peers == [1] and t1.shm_peers == [0] and t0.name == "tcp"
        assert t0.single_copy_peers == ([1] if single_copy else [])
        assert not _leftovers(t0.job_id)
        for t in (t0, t1):
            t.stats.reset()
        rng = np.random.default_rng(3)
        payloads = [rng.integers(0, 256, n, dtype=np.uint8) for n in SIZES]
        got = [np.zeros(n, np.uint8) for n in SIZES]
        pieces: list[list[tuple[int, int]]] = [[] for _ in SIZES]
        consumed = [np.zeros(n, np.uint8) for n in SIZES]

        def sink(i: int) -> Any:
            def consume(offset: int, chunk: memoryview) -> None:
                pieces[i].append((offset, len(chunk)))
                consumed[i][offset:offset + len(chunk)] = np.frombuffer(chunk, np.uint8)
            return consume

        reqs = []
        for i, n in enumerate(SIZES):  # 1 -> 0 into buffers, 0 -> 1 consumed
            reqs.append(t0.irecv(1, got[i].data, _h(i, n)))
            reqs.append(t1.irecv_consume(0, n, _h(i, n), sink(i)))
        for i, n in enumerate(SIZES):
            reqs.append(t1.isend(0, payloads[i].data, _h(i, n)))
            reqs.append(t0.isend(1, payloads[i].data, _h(i, n)))
        deadline = time.monotonic() + 30
        for r in reqs:
            r.wait(deadline)
        for i, n in enumerate(SIZES):
            np.testing.assert_array_equal(got[i], payloads[i])
            np.testing.assert_array_equal(consumed[i], payloads[i])
            offs = [o for o, _ in pieces[i]]
            lens = [k for _, k in pieces[i]]
            assert offs == sorted(offs) and sum(lens) == n
            assert all(k % 8 == 0 and k <= max(shm.CHUNK_BYTES, shm.SINGLE_COPY_CONSUME_BYTES)
                       for k in lens[:-1]), lens
        want = sum(HEADER_SIZE + n for n in SIZES)
        for t in (t0, t1):
            assert t.stats_local.snapshot() == {
                "bytes_sent": want, "bytes_received": want,
                "messages_sent": len(SIZES), "messages_received": len(SIZES)}
            assert t.stats_remote.snapshot()["bytes_sent"] == 0
            assert t.stats.snapshot() == t.stats_local.snapshot()
            assert t.stats.bytes_sent == want
    finally:
        _close([t0, t1])


def test_a_forked_child_does_not_keep_the_doorbells() -> None:
    """A process forked by a rank (a DataLoader worker) closes its copies of the doorbells,
    so that the rank's death is still an end of file for its peers."""
    t0, t1 = _thread_world(2)
    try:
        assert isinstance(t0, HybridTransport)
        fds = list(t0._peers[1].ch._fds)
        assert len(fds) == 4
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report which doorbells are still open, then leave
            still = [fd for fd in fds if _is_fifo(fd)]
            os.write(write_end, str(len(still)).encode())
            os._exit(0)
        os.close(write_end)
        got = os.read(read_end, 16)
        os.close(read_end)
        os.waitpid(pid, 0)
        assert got == b"0", got
        assert all(_is_fifo(fd) for fd in fds)  # the parent keeps them
    finally:
        _close([t0, t1])


def _is_fifo(fd: int) -> bool:
    try:
        return stat.S_ISFIFO(os.fstat(fd).st_mode)
    except OSError:
        return False


def test_header_mismatch_is_a_protocol_error_and_aborts_the_peer() -> None:
    t0, t1 = _thread_world(2)
    try:
        deadline = time.monotonic() + 20
        data = np.arange(16, dtype=np.uint8)
        t0.isend(1, data.data, _h(0, 16)).wait(deadline)
        with pytest.raises(ProtocolError, match="step 0, expected step 1"):
            t1.irecv(0, np.zeros(16, np.uint8).data, _h(1, 16)).wait(deadline)
        with raises_comm(PeerLostError, peer=1, rank=0):  # (rank 1 aborted)
            t0.irecv(1, np.zeros(4, np.uint8).data, _h(0, 4)).wait(deadline)
    finally:
        _close([t0, t1])


def _finishers(monkeypatch: pytest.MonkeyPatch) -> dict[tuple[bool, int], str]:
    """Record, per (is_send, payload bytes), the name of the thread that completed a request
    (shared-memory and TCP requests alike)."""
    seen: dict[tuple[bool, int], str] = {}
    original = FrameRequest._finish

    def finish(self: FrameRequest, error: Any) -> None:
        if not self._done:
            seen[self.is_send, self.header.length] = threading.current_thread().name
        original(self, error)

    monkeypatch.setattr(FrameRequest, "_finish", finish)
    return seen


@pytest.mark.parametrize("path", ["shm", "tcp"])
def test_small_frames_progress_on_the_calling_thread_large_ones_on_the_receiver(
        path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A small receive, plain or consumed (posted before its frame is written), completes on
    the thread that waits for it, with no helper thread; a large one on the peer's receiver
    thread. The payloads arrive whole either way. Both paths of the TCP backend."""
    t0, t1 = _thread_world(2, hosts=[0, 0] if path == "shm" else [0, 1])
    assert isinstance(t1, HybridTransport if path == "shm" else TCPTransport)
    seen = _finishers(monkeypatch)
    try:
        me = threading.current_thread().name
        deadline = time.monotonic() + 20
        small, large = 64, peer_mod.HELPER_RECEIVE_BYTES
        payload = np.random.default_rng(5).integers(0, 256, large, dtype=np.uint8)
        got_small, got_large = np.zeros(small, np.uint8), np.zeros(large, np.uint8)
        r_small = t1.irecv(0, got_small.data, _h(0, small))
        assert not r_small.done()  # nothing sent yet
        s_small = t0.isend(1, payload[:small].data, _h(0, small))
        r_small.wait(deadline)
        s_small.wait(deadline)
        np.testing.assert_array_equal(got_small, payload[:small])
        assert seen[False, small] == me, seen
        assert seen[True, small] == me  # written by isend itself
        # progress() completes a receive whose frame is there, without anybody waiting.
        r_again = t1.irecv(0, got_small.data, _h(9, small))
        assert not r_again.done()
        t0.isend(1, payload[small:2 * small].data, _h(9, small)).wait(deadline)
        if path == "tcp":  # the bytes must have reached the socket (no sleep: a readiness wait)
            assert isinstance(t1, TCPTransport)
            assert select.select([t1._peers[0].sock], [], [], 20)[0]
        t1.progress()
        assert r_again.done()
        np.testing.assert_array_equal(got_small, payload[small:2 * small])

        # A small consumed frame: on the calling thread too; a large one (plain or consumed):
        # on the receiver thread.
        consumed_small = np.zeros(100, np.uint8)
        consumed_large = np.zeros(large, np.uint8)

        def into(target: Any) -> Any:
            def consume(offset: int, chunk: memoryview) -> None:
                target[offset:offset + len(chunk)] = np.frombuffer(chunk, np.uint8)
            return consume

        r_cons = t1.irecv_consume(0, 100, _h(1, 100), into(consumed_small))
        t0.isend(1, payload[:100].data, _h(1, 100)).wait(deadline)
        r_cons.wait(deadline)
        np.testing.assert_array_equal(consumed_small, payload[:100])
        assert seen[False, 100] == me, seen

        r_large = t1.irecv(0, got_large.data, _h(2, large))
        r_cons_large = t1.irecv_consume(0, large, _h(3, large), into(consumed_large))
        sends = [t0.isend(1, payload.data, _h(2, large)),
                 t0.isend(1, payload.data, _h(3, large))]
        for r in (r_large, r_cons_large, *sends):
            r.wait(deadline)
        np.testing.assert_array_equal(got_large, payload)
        np.testing.assert_array_equal(consumed_large, payload)
        helper = f"bitcoll-{path}-recv-1-from-0"
        assert seen[False, large] == helper, seen
        assert t1.peer_state(0) is PeerState.OPEN
    finally:
        _close([t0, t1])
    assert t1.peer_state(0) is PeerState.CLOSED


@pytest.mark.parametrize("cores", [1, 64])
def test_an_oversubscribed_host_spins_less(cores: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """With more ranks on the host than cores, a waiter looks at the ring for
    OVERSUBSCRIBED_SPIN_SECONDS (yielding the core) instead of SPIN_SECONDS; small frames
    still complete on the waiting thread."""
    monkeypatch.setattr(topology_mod, "usable_cores", lambda: cores)
    t0, t1 = _thread_world(2)
    seen = _finishers(monkeypatch)
    try:
        assert isinstance(t1, HybridTransport)
        assert t1.oversubscribed is (cores == 1)
        assert t1._spin == (peer_mod.OVERSUBSCRIBED_SPIN_SECONDS if cores == 1
                            else peer_mod.SPIN_SECONDS)
        deadline = time.monotonic() + 20
        got = np.zeros(16, np.uint8)
        r = t1.irecv(0, got.data, _h(0, 16))
        t0.isend(1, np.arange(16, dtype=np.uint8).data, _h(0, 16)).wait(deadline)
        r.wait(deadline)
        assert got.tolist() == list(range(16))
        assert seen[False, 16] == threading.current_thread().name
    finally:
        _close([t0, t1])


def test_a_wait_on_tcp_hands_the_shared_memory_receives_to_their_thread() -> None:
    """Ranks 0 and 1 share a host, rank 2 is on another. Rank 0 posts three small receives
    from rank 1, whose frames fill its 8 KiB ring, then waits on a TCP receive from rank 2
    first. Rank 2 sends only once rank 1's third send (which needs rank 0 to read the
    first) has completed: the wait on TCP must hand the shared-memory receives to the
    receiver thread, or the three ranks would wait on each other until the deadline."""
    ts = _thread_world(3, hosts=[0, 0, 1], ring_bytes=8192)
    h0, h1, t2 = ts
    try:
        assert isinstance(h0, HybridTransport) and h0.shm_peers == [1]
        deadline = time.monotonic() + 20
        n = 4000
        third_sent = threading.Event()
        errors: list[BaseException] = []
        got = [np.zeros(n, np.uint8) for _ in range(3)]
        reqs = [h0.irecv(1, g.data, _h(i, n)) for i, g in enumerate(got)]
        tcp_got = np.zeros(8, np.uint8)
        tcp_req = h0.irecv(2, tcp_got.data, _h(0, 8))
        # Rank 1 writes its three frames before anything on rank 0 waits: nobody reads rank
        # 0's ring yet, so the third frame cannot be in it.
        frames = [np.full(n, i, np.uint8) for i in range(3)]
        sends = [h1.isend(0, f.data, _h(i, n)) for i, f in enumerate(frames)]
        assert sends[0].done() and sends[1].done() and not sends[2].done()

        def rank1() -> None:
            try:
                for r in sends:
                    r.wait(deadline)
                third_sent.set()
            except BaseException as exc:
                errors.append(exc)

        def rank2() -> None:
            try:
                assert third_sent.wait(20)
                t2.isend(0, np.full(8, 9, np.uint8).data, _h(0, 8)).wait(deadline)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=rank1), threading.Thread(target=rank2)]
        for t in threads:
            t.start()
        tcp_req.wait(deadline)
        for r in reqs:
            r.wait(deadline)
        for t in threads:
            t.join(20)
        assert not errors, errors
        assert tcp_got.tolist() == [9] * 8
        assert [int(g[0]) for g in got] == [0, 1, 2] and all(len(set(g)) == 1 for g in got)
    finally:
        _close(ts)


@pytest.mark.parametrize("single_copy", [False, True])
def test_abort_fails_a_blocked_receive_and_a_blocked_send_at_once(single_copy: bool) -> None:
    """Rank 1 waits in a receive and in a send larger than the ring (or one that waits to be
    copied) that rank 0 never reads; rank 0 aborts: both fail within a fraction of a
    second, naming rank 0's reason."""
    t0, t1 = _thread_world(2, ring_bytes=8192, single_copy=single_copy,
                           single_copy_min_bytes=4096)
    try:
        assert isinstance(t1, HybridTransport)
        assert t1.single_copy_peers == ([0] if single_copy else [])
        recv = t1.irecv(0, np.zeros(8, np.uint8).data, _h(0, 8))
        big = np.ones(1 << 20, np.uint8)
        send = t1.isend(0, big.data, _h(0, big.size))
        assert not send.done()  # the ring is full: the sender thread waits for space
        t0.abort("the optimizer diverged")
        for req in (recv, send):  # PeerLostError: the abort, not the deadline, ended them
            with pytest.raises(PeerLostError, match="rank 0 aborted: the optimizer diverged"):
                req.wait(time.monotonic() + 20)
        assert isinstance(t1.failure, PeerLostError)
    finally:
        _close([t0, t1])


@pytest.mark.parametrize("path", ["shm", "tcp"])
def test_one_failure_record_whichever_side_fails_first(path: str) -> None:
    """Ranks 0 and 1 share a host, rank 2 is on another. Rank 0 fails while consuming a
    frame from rank 1 (shared memory) or from rank 2 (TCP): its error names rank 0 and that
    peer, and is the one failure of both sides of its hybrid transport (the same object,
    recorded once). Ranks 1 and 2, waiting on rank 0 over shared memory and over TCP, fail
    with PeerLostError naming rank 0's abort and that same cause, recorded once on each
    (possibly relayed by rank 1, which learns first)."""
    h0, h1, t2 = _thread_world(3, hosts=[0, 0, 1])
    src = 1 if path == "shm" else 2
    try:
        assert isinstance(h0, HybridTransport) and isinstance(h1, HybridTransport)
        assert isinstance(t2, TCPTransport) and h0.shm_peers == [1]
        deadline = time.monotonic() + 20

        def refuse(pos: int, chunk: memoryview) -> None:
            raise ValueError("this consumer refuses every piece")

        got = h0.irecv_consume(src, 64, _h(0, 64), refuse)
        (h1 if src == 1 else t2).isend(0, np.ones(64, np.uint8).data, _h(0, 64))
        with pytest.raises(CommError) as caught:
            got.wait(deadline)
        cause = caught.value
        assert type(cause) is CommError and (cause.rank, cause.peer) == (0, src)
        assert f"consuming a frame from rank {src} failed" in str(cause)
        assert h0.failure is cause and h0.tcp.failure is cause

        errors: dict[int, BaseException] = {}

        def wait_on_rank0(r: int, t: Transport) -> None:
            try:
                t.irecv(0, np.zeros(8, np.uint8).data, _h(1, 8)).wait(deadline)
            except BaseException as exc:
                errors[r] = exc

        waiters = [threading.Thread(target=wait_on_rank0, args=(r, t))
                   for r, t in ((1, h1), (2, t2))]
        for w in waiters:
            w.start()
        for w in waiters:
            w.join(30)
        for r, t in ((1, h1), (2, t2)):
            err = errors.get(r)
            assert isinstance(err, PeerLostError), (r, err)
            assert str(err).endswith(f"rank 0 aborted: {cause}"), (r, str(err))
            assert err.rank == r and err.peer in (0, 1), (r, err.rank, err.peer)
            assert t.failure is err
        assert h1.tcp.failure is h1.failure
    finally:
        _close([h0, h1, t2])


def test_receive_nobody_sends_times_out_and_leaves_the_transport_healthy() -> None:
    t0, t1 = _thread_world(2)
    try:
        start = time.monotonic()
        req = t0.irecv(1, np.zeros(4, np.uint8).data, _h(0, 4))
        with raises_comm(CommTimeoutError, peer=1, silent=1):
            req.wait(start + 0.3)
        assert t0.failure is None
        t1.isend(0, np.ones(4, np.uint8).data, _h(0, 4))
        req.wait(time.monotonic() + 10)  # the same receive completes later
    finally:
        _close([t0, t1])


def test_frames_sent_before_close_arrive_then_the_peer_is_lost() -> None:
    t0, t1 = _thread_world(2)
    data = np.arange(100, dtype=np.uint8)
    t1.isend(0, data.data, _h(0, 100)).wait(time.monotonic() + 10)
    t1.close()  # rank 1 (not rank 0: it keeps the store until the others left)
    try:
        got = np.zeros(100, np.uint8)
        t0.irecv(1, got.data, _h(0, 100)).wait(time.monotonic() + 10)
        np.testing.assert_array_equal(got, data)
        with raises_comm(PeerLostError, peer=1, rank=0):
            t0.irecv(1, got.data, _h(1, 100)).wait(time.monotonic() + 10)
    finally:
        t0.close()


def _killed_mid_frame(t: TCPTransport, single_copy: bool) -> tuple[str, str]:
    """Rank 2 dies with SIGKILL while its 8 MiB frame to rank 0 is in the ring (or waits to
    be copied); rank 0 posts the receive only once rank 2 is dead, so the frame is always
    cut; rank 1 waits for rank 0 and learns about the loss through rank 0's abort."""
    h = HybridTransport.create(t, [0, 0, 0], 20, single_copy=single_copy)
    assert isinstance(h, HybridTransport)
    deadline = time.monotonic() + 30.0
    big = 8 << 20
    try:
        if h.rank == 2:
            pid = np.array([os.getpid()], dtype=np.int64)
            h.isend(0, pid.view(np.uint8).data, _h(0, 8)).wait(deadline)
            src = np.ones(big, dtype=np.uint8)
            h.isend(0, src.data, _h(1, big))
            ch = h._peers[0].ch
            single = single_copy and ch.single_copy
            # Polls a condition (sets up no interleaving): the record is in the ring, the
            # ring full (inline frame) or the single-copy record written.
            while not (ch.copies_sent if single else ch.out_free() == 0):
                time.sleep(0.001)
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            if h.rank == 0:
                pid = np.zeros(1, dtype=np.int64)
                h.irecv(2, pid.view(np.uint8).data, _h(0, 8)).wait(deadline)
                tcp_world.wait_dead(int(pid[0]), deadline)
                h.irecv(2, np.zeros(big, np.uint8).data, _h(1, big)).wait(deadline)
            else:
                h.irecv(0, np.zeros(4, np.uint8).data, _h(0, 4)).wait(deadline)
        except CommError as exc:
            return type(exc).__name__, str(exc)
        return "none", ""
    finally:
        h.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("single_copy", [False, True])
def test_a_rank_killed_mid_frame_fails_the_others_quickly(single_copy: bool) -> None:
    res = tcp_world.run_world(3, _killed_mid_frame, single_copy, timeout=50)
    assert res[2].exitcode == -signal.SIGKILL
    # PeerLostError on both, not the CommTimeoutError of their 30 s deadline: the loss was
    # detected and spread, not waited out.
    kind0, msg0 = res[0].unwrap()
    assert kind0 == "PeerLostError" and "lost rank 2" in msg0, msg0
    kind1, msg1 = res[1].unwrap()
    assert kind1 == "PeerLostError" and msg1.startswith("rank 0 aborted:"), msg1
    assert "lost rank 2" in msg1, msg1


# ------------------------------------------------------------------ set-up and security


def _offer_and_tamper(tamper: Any) -> tuple[shm.ShmChannel | None, str]:
    made = shm.offer(0x1234, 4096)
    assert made.mm is not None
    paths = shm.segment_names(made.base)
    for path in paths:
        assert os.stat(path).st_mode & 0o777 == 0o600
    message = tamper(made, paths)
    try:
        ch, _, why = shm.accept(0, message)
        if ch is not None:
            ch.close()
        return ch, why
    finally:
        shm.discard_offer(made)
        assert not any(os.path.lexists(p) for p in paths)


def test_a_good_offer_is_accepted_and_every_name_unlinked() -> None:
    ch, why = _offer_and_tamper(lambda made, paths: made.message)
    assert ch is not None and why == ""


@pytest.mark.parametrize("how", ["mode", "owner", "nonce", "name", "symlink", "size"])
def test_a_doubtful_segment_is_refused(how: str) -> None:
    def tamper(made: shm.Offer, paths: list[str]) -> bytes:
        msg = bytearray(made.message)
        if how == "mode":
            os.chmod(paths[0], 0o644)
        elif how == "owner":
            if os.geteuid() != 0:
                pytest.skip("chown needs root")
            os.chown(paths[0], 4242, -1)
        elif how == "nonce":
            msg[16] ^= 1
        elif how == "name":
            msg[32:44] = b"../../etc/pw"
        elif how == "symlink":
            os.rename(paths[0], paths[0] + "-real")
            os.symlink(paths[0] + "-real", paths[0])
        else:
            os.truncate(paths[0], 8192)
        return bytes(msg)

    try:
        ch, why = _offer_and_tamper(tamper)
    finally:
        for p in glob.glob(os.path.join(shm.SHM_DIR, "bitcoll-shm-0000000000001234-*")):
            os.unlink(p)
    assert ch is None and why, why


def test_single_copy_probe_reads_only_what_it_was_told() -> None:
    probe = shm.Probe()
    assert shm.probe_peer(os.getpid(), probe.address, probe.data)
    assert not shm.probe_peer(os.getpid(), probe.address, bytes(16))
    assert not shm.probe_peer(0, probe.address, probe.data)


def test_shm_setting() -> None:
    env = os.environ.get("BITCOLL_SHM")
    try:
        os.environ["BITCOLL_SHM"] = "0"
        assert shm_enabled(None) is False and shm_enabled(True) is True
        os.environ["BITCOLL_SHM"] = "1"
        assert shm_enabled(None) is True and shm_enabled(False) is False
        os.environ["BITCOLL_SHM"] = "yes"
        with raises_usage("BITCOLL_SHM"):
            shm_enabled(None)
        with raises_usage("shm"):
            shm_enabled(1)  # type: ignore[arg-type]
    finally:
        if env is None:
            os.environ.pop("BITCOLL_SHM", None)
        else:
            os.environ["BITCOLL_SHM"] = env


# ------------------------------------------------------------------ real processes


def _sweeps(comm: Communicator) -> tuple[str, list[int], int]:
    t = comm.transport
    assert isinstance(t, HybridTransport) and comm.backend == "tcp"
    # Every pair's names are gone once its side 1 has accepted, which its set-up does before
    # it returns: after a barrier no rank is still in set-up (before it, another pair's
    # offer may still be waiting for its side 1).
    comm.barrier()
    assert not _leftovers(t.job_id)
    comm.stats.reset()
    n = dense_sweep(comm, lengths=(0, 1, 1000, 300_007), dtypes=("float32", "int8"))
    comm.segment_bytes = 40  # many tiny frames through the rings
    n += dense_sweep(comm, lengths=(1000,), dtypes=("float32",))
    comm.segment_bytes = bitcoll.DEFAULT_SEGMENT_BYTES
    n += inplace_and_async(comm)
    n += packed_sweep(comm, lengths=(65, 100_003), algorithms=("direct", "allgather"))
    comm.packed_segment_bytes = 8
    n += packed_sweep(comm, lengths=(4099,), algorithms=("direct",))
    comm.packed_segment_bytes = None
    packed_bandwidth(comm)  # exact byte counts through comm.stats
    assert t.stats_remote.snapshot()["bytes_sent"] == 0  # every peer through shared memory
    assert comm.stats.snapshot() == t.stats_local.snapshot()
    return type(t).__name__, t.shm_peers, n


@pytest.mark.timeout(200)
@pytest.mark.parametrize("size", [2, 3, 4])
def test_sweeps_over_shared_memory(size: int) -> None:
    res = run_world(size, _sweeps, timeout=180, shm=True)
    for r, (kind, peers, n) in enumerate(res):
        assert kind == "HybridTransport" and peers == [p for p in range(size) if p != r]
        assert n == res[0][2] > 100


def _mixed(comm: Communicator) -> dict[str, Any]:
    t = comm.transport
    assert isinstance(t, HybridTransport)
    dense_sweep(comm, lengths=(1, 100_003), dtypes=("float32",))
    packed_sweep(comm, lengths=(4099,), algorithms=("direct",))
    # One frame to and from every peer: each counted on its own path, exactly.
    comm.barrier()
    t.stats.reset()
    deadline = time.monotonic() + 30
    n = 1000 + comm.rank
    reqs = []
    for p in range(comm.size):
        if p != comm.rank:
            reqs.append(t.irecv(p, np.zeros(1000 + p, np.uint8).data,
                                _h(0, 1000 + p, seq=1 << 40)))
            reqs.append(t.isend(p, np.ones(n, np.uint8).data, _h(0, n, seq=1 << 40)))
    for r in reqs:
        r.wait(deadline)
    local, remote = t.stats_local.snapshot(), t.stats_remote.snapshot()
    host, cross = comm.host_comm(), comm.cross_host_comm()
    host_peers = getattr(host.transport, "shm_peers", None)
    out = {"peers": t.shm_peers, "local": local, "remote": remote,
           "tcp_overhead": t.tcp.frame_overhead,
           "host": (type(host.transport).__name__, host_peers),
           "cross": type(cross.transport).__name__,
           "host_sum": int(host.allreduce(np.ones(3, np.int32))[0]),
           "cross_sum": int(cross.allreduce(np.ones(3, np.int32))[0])}
    return out


@pytest.mark.timeout(200)
def test_mixed_hosts_use_shared_memory_only_within_a_host() -> None:
    """Ranks 0, 2 on one fake host and 1, 3 on another (GROUP_RANK)."""
    env = {r: {"GROUP_RANK": str(r % 2)} for r in range(4)}
    res = run_world(4, _mixed, timeout=180, rank_env=env, shm=True)
    for r, out in enumerate(res):
        mate = (r + 2) % 4
        assert out["peers"] == [mate], out
        others = [p for p in range(4) if p not in (r, mate)]
        assert out["local"] == {"bytes_sent": HEADER_SIZE + 1000 + r,
                                "bytes_received": HEADER_SIZE + 1000 + mate,
                                "messages_sent": 1, "messages_received": 1}, out
        over = out["tcp_overhead"]  # header, and the checksum when TCP frames carry one
        assert out["remote"] == {"bytes_sent": 2 * (over + 1000 + r),
                                 "bytes_received": sum(over + 1000 + p for p in others),
                                 "messages_sent": 2, "messages_received": 2}, out
        assert out["host"] == ("HybridTransport", [1 - r // 2]), out
        assert out["cross"] == "TCPTransport" and out["host_sum"] == out["cross_sum"] == 2


def _kind(comm: Communicator) -> str:
    comm.allreduce(np.ones(10, np.float32))
    return type(comm.transport).__name__


@pytest.mark.timeout(120)
def test_bitcoll_shm_0_gives_the_plain_tcp_transport_and_ranks_must_agree() -> None:
    env = {r: {"BITCOLL_SHM": "0"} for r in range(2)}
    assert run_world(2, _kind, timeout=100, rank_env=env) == ["TCPTransport"] * 2
    env = {r: {"BITCOLL_SHM": "1"} for r in range(2)}
    assert run_world(2, _kind, timeout=100, rank_env=env, shm=False) == ["TCPTransport"] * 2
    env = {0: {"BITCOLL_SHM": "1"}, 1: {"BITCOLL_SHM": "0"}}
    with pytest.raises(AssertionError, match="disagree on shared memory") as info:
        run_world(2, _kind, timeout=100, rank_env=env)
    assert "rank 0 failed" in str(info.value) and "rank 1 failed" in str(info.value)


def _victim(rank: int, size: int, port: int, q: Any, second: int) -> None:
    os.environ.update(tcp_env(rank, size, port))
    os.environ["NUMBA_NUM_THREADS"] = "1"
    comm = bitcoll.init("tcp", timeout=60, shm=True)
    t = comm.transport
    assert isinstance(t, HybridTransport)
    x = np.ones(2 << 20, np.float32)  # 8 MiB: blocks large enough for single copy
    comm.allreduce(x)
    # Counted once every rank has finished its set-up (they all took part in the
    # all-reduce): before, another pair's offer may still wait for its side 1.
    q.put((rank, "job", t.job_id, len(_leftovers(t.job_id))))
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # between two collectives, segments mapped
    try:
        comm.allreduce(x[:second])
        q.put((rank, "no error", "", None))
    except Exception as exc:
        q.put((rank, type(exc).__name__, str(exc), None))
    comm.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("second", [2 << 20, 8])
def test_a_killed_rank_fails_the_others_fast_and_leaves_nothing_in_dev_shm(second: int) -> None:
    """Rank 1 is killed between two all-reduces; the others' second all-reduce (8 MiB:
    frames the receiver threads read by single copy; 8 elements: frames the waiting
    threads read from the ring themselves) fails fast, naming it."""
    q = context(__name__).Queue()
    port = free_port()
    procs = [start(_victim, r, 3, port, q, second) for r in range(3)]
    jobs: set[int] = set()
    outcome: dict[int, tuple[str, str]] = {}
    try:
        while len(outcome) < 2:
            rank, kind, a, b = q.get(timeout=90)
            if kind == "job":
                jobs.add(a)
                assert b == 0, "segments must be unlinked once both sides mapped them"
            else:
                outcome[rank] = (kind, a)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    assert procs[1].exitcode == -signal.SIGKILL
    assert sorted(outcome) == [0, 2], outcome
    for kind, msg in outcome.values():  # not the CommTimeoutError of the 60 s deadline
        assert kind == "PeerLostError" and "rank 1" in msg, outcome
    assert len(jobs) == 1 and not _leftovers(jobs.pop())
