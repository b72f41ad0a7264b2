"""Tests of the MPI transport (bitcoll.transport.mpi).

Run under MPI with any world size >= 2, for example::

    mpiexec -n 3 python -m pytest --with-mpi -q -m mpi tests/test_mpi_transport.py

Plain ``pytest`` runs only the unit tests that need no MPI and skips the MPI tests. Every
MPI test creates its own transport (a private duplicate of COMM_WORLD), so a test that aborts
its transport, or fails half-way on one rank, cannot disturb the next one. Expected data are
computed locally from seeds. The split tests need at least 3 ranks. The exit rules (uncaught
exceptions, a stopped rank) are tested with real mpiexec jobs in ``test_mpi_failures.py``.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from types import FrameType
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from errcheck import raises_usage

import bitcoll.transport.mpi.lifecycle as mpi_lifecycle
import bitcoll.transport.mpi.requests as mpi_requests
import bitcoll.transport.mpi.transport as mpi_module
from bitcoll.errors import (
    CommError,
    CommTimeoutError,
    PeerLostError,
    ProtocolError,
    UsageError,
)
from bitcoll.kernels.stream import MODE_FOLD, MODE_FOLD_DIVIDE, MODE_LAND
from bitcoll.partition import partition
from bitcoll.transport.base import HEADER_SIZE, FrameHeader, Request, StreamPlan
from bitcoll.transport.mpi import (
    DATA_TAG,
    INLINE_MAX,
    MPITransport,
    launched_by_mpi,
    mpi_available,
)
from bitcoll.transport.mpi.requests import _MPIRequest

TIMEOUT = 10.0  # seconds: bitcoll deadlines in these tests
# Seconds: an abort or mismatch must reach every rank before the deadline a rank waiting
# for a silent peer would run into (a bound that no scheduling delay can break: only a rank
# that waited the deadline out exceeds it).
PROMPT = TIMEOUT
SIG = 0x5EED
MIB = 1 << 20
LENGTHS = [0, 1, 7, INLINE_MAX, INLINE_MAX + 1, MIB]

mpi = pytest.mark.mpi(min_size=2)
mpi3 = pytest.mark.mpi(min_size=3)  # splits by parity: at least one group of two


def _wait_all(requests: Iterable[Request], deadline: float) -> None:
    """Wait for every request; the first failure is raised."""
    for req in requests:
        req.wait(deadline)


def _deadline(seconds: float = TIMEOUT) -> float:
    return time.monotonic() + seconds


def _payload(src: int, dst: int, length: int, salt: int = 0) -> npt.NDArray[np.uint8]:
    """The bytes rank ``src`` sends to rank ``dst`` (reproducible on every rank)."""
    rng = np.random.default_rng([src, dst, length, salt])
    return rng.integers(0, 256, size=length, dtype=np.uint8)


def _header(length: int, step: int = 0, seq: int = 1, sig: int = SIG) -> FrameHeader:
    return FrameHeader(seq=seq, step=step, signature=sig, length=length)


def _world_barrier() -> None:
    from mpi4py import MPI

    MPI.COMM_WORLD.Barrier()


def _shared_dir() -> str:
    """A fresh directory every rank of the job sees (made by rank 0, removed by the test)."""
    from mpi4py import MPI

    path = tempfile.mkdtemp(prefix="bitcoll-marks-") if MPI.COMM_WORLD.Get_rank() == 0 \
        else None
    shared = MPI.COMM_WORLD.bcast(path, root=0)
    assert isinstance(shared, str)
    return shared


def _mark_when_waiting(path: str,
                       within: Callable[[FrameType], bool] | None = None) -> threading.Thread:
    """Create the file ``path`` as soon as the calling thread is inside a wait loop of the
    MPI transport (a request found not complete and is backing off: ``_Poller.pause`` on its
    stack), and, if ``within`` is given, some frame further up that stack satisfies it. The
    other ranks wait for these marks instead of sleeping."""
    ident = threading.get_ident()

    def watch() -> None:
        end = time.monotonic() + 30.0
        while time.monotonic() < end:
            frame = sys._current_frames().get(ident)
            pausing = False
            while frame is not None:
                if frame.f_code.co_name == "pause" and \
                        frame.f_code.co_filename == mpi_requests.__file__:
                    pausing = True
                if pausing and (within is None or within(frame)):
                    with open(path, "w"):
                        return
                frame = frame.f_back
            time.sleep(0.001)  # polls a condition; sets up no interleaving

    th = threading.Thread(target=watch, daemon=True)
    th.start()
    return th


def _await_marks(directory: str, ranks: list[int]) -> None:
    """Return once every rank of ``ranks`` is inside its wait (see _mark_when_waiting)."""
    end = time.monotonic() + 30.0
    while not all(os.path.exists(os.path.join(directory, str(r))) for r in ranks):
        assert time.monotonic() < end, "a rank never entered its wait"
        time.sleep(0.001)  # polls a condition


@pytest.fixture
def transport() -> Iterator[MPITransport]:
    t = MPITransport.create(timeout=TIMEOUT)
    try:
        yield t
    finally:
        t.close()


def _expect_peer_abort(t: MPITransport, silent_peer: int, origin: str) -> None:
    """Wait on a receive nobody will send; it must fail promptly because a peer aborted."""
    start = time.monotonic()
    buf = np.empty(4, dtype=np.uint8)
    with pytest.raises(CommError) as info:
        t.irecv(silent_peer, buf.data, _header(4, seq=99)).wait(_deadline())
    elapsed = time.monotonic() - start
    assert not isinstance(info.value, CommTimeoutError), info.value
    assert elapsed < PROMPT, f"the abort took {elapsed:.2f} s to arrive"
    assert isinstance(info.value, PeerLostError), repr(info.value)
    assert origin in str(info.value)
    assert t.failure is info.value
    with pytest.raises(PeerLostError):
        t.isend(silent_peer, memoryview(b""), _header(0))


def _ring_rounds(t: MPITransport, rounds: int, salt: int,
                 who: Callable[[int], int] = lambda r: r) -> None:
    """``rounds`` ring exchanges on ``t`` (a one-rank transport exchanges with itself), of
    inline and two-message sizes. Every frame has the same headers (seq 1, step i) as those
    of any other transport's rounds: only the communicators keep them apart. ``who`` maps a
    rank of ``t`` to its world rank: payloads name the world ranks of both ends and ``salt``.
    """
    right, left = (t.rank + 1) % t.size, (t.rank - 1) % t.size
    me = who(t.rank)
    sizes = [0, 5, INLINE_MAX + 3, 100_000]
    for i in range(rounds):
        n = sizes[i % len(sizes)]
        data = _payload(me, who(right), n, salt=salt * 1000 + i)
        out = np.empty(n, np.uint8)
        reqs = [t.irecv(left, out.data, _header(n, step=i)),
                t.isend(right, data.data, _header(n, step=i))]
        _wait_all(reqs, _deadline())
        np.testing.assert_array_equal(out, _payload(who(left), me, n, salt=salt * 1000 + i))


# --------------------------------------------------------------------------------------------
# Environment detection (no MPI needed)
# --------------------------------------------------------------------------------------------

_LAUNCH_VARS = ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK",
                "PMI_SIZE", "PMI_FD", "PMI_PORT", "HYDI_CONTROL_FD", "MPI_LOCALNRANKS",
                "MPI_LOCALRANKID", "SLURM_PROCID", "SLURM_NTASKS")


def test_launched_by_mpi_reads_the_environment(monkeypatch: pytest.MonkeyPatch,
                                               tmp_path: Any) -> None:
    for var in _LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)
    assert launched_by_mpi() is False

    monkeypatch.setenv("SLURM_PROCID", "0")  # a plain srun step is not an MPI job
    monkeypatch.setenv("SLURM_NTASKS", "4")
    assert launched_by_mpi() is False
    monkeypatch.setenv("PMIX_RANK", "0")  # srun --mpi=pmix
    assert launched_by_mpi() is True
    monkeypatch.delenv("PMIX_RANK")

    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    assert launched_by_mpi() is True
    monkeypatch.delenv("OMPI_COMM_WORLD_SIZE")

    # Hydra / PMI-2: PMI_RANK plus a live PMI socket (or a PMI port).
    monkeypatch.setenv("PMI_RANK", "1")
    monkeypatch.setenv("PMI_SIZE", "4")
    assert launched_by_mpi() is False
    a, b = socket.socketpair()
    try:
        monkeypatch.setenv("PMI_FD", str(a.fileno()))
        assert launched_by_mpi() is True
        # Inherited variables whose descriptor is gone (a child of an MPI rank).
        closed_fd = a.fileno()
        a.close()
        monkeypatch.setenv("PMI_FD", str(closed_fd))
        assert launched_by_mpi() is False
    finally:
        a.close()
        b.close()
    regular = tmp_path / "not-a-socket"
    regular.write_bytes(b"")
    with open(regular, "rb") as f:
        monkeypatch.setenv("PMI_FD", str(f.fileno()))
        assert launched_by_mpi() is False
    monkeypatch.setenv("PMI_FD", "not-a-number")
    assert launched_by_mpi() is False
    monkeypatch.setenv("PMI_PORT", "host:1234")
    assert launched_by_mpi() is True
    monkeypatch.delenv("PMI_RANK")
    assert launched_by_mpi() is False  # PMI_PORT without a rank is not a launch


def test_mpi_available_without_initializing_mpi() -> None:
    was_loaded = "mpi4py.MPI" in sys.modules
    assert mpi_available() is True  # mpi4py is a test dependency
    assert ("mpi4py.MPI" in sys.modules) == was_loaded


def test_request_base_class_is_abstract() -> None:
    assert _MPIRequest.__abstractmethods__ == frozenset({"_progress", "_describe"})
    with pytest.raises(TypeError, match="abstract"):
        _MPIRequest(None, [], ())  # type: ignore[abstract, arg-type]


# --------------------------------------------------------------------------------------------
# Set-up
# --------------------------------------------------------------------------------------------


@mpi
@pytest.mark.timeout(30)
def test_launched_by_mpi_under_mpiexec() -> None:
    assert launched_by_mpi() is True
    assert mpi_available() is True


@mpi
@pytest.mark.timeout(30)
def test_create_uses_a_private_duplicate(transport: MPITransport) -> None:
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    assert (transport.rank, transport.size) == (world.Get_rank(), world.Get_size())
    assert transport.name == "mpi"
    assert transport.failure is None
    assert transport.finalize_risk is None
    assert mpi_lifecycle._hook_installed  # the exit rules are in place (test_mpi_failures.py)
    assert MPI.Comm.Compare(transport.comm, world) == MPI.CONGRUENT  # same group, new context
    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        assert transport.oversubscribed == (node.Get_size() > len(os.sched_getaffinity(0)))
    finally:
        node.Free()
    # A user message on COMM_WORLD with the transport's tag never reaches the transport.
    peer_to = (transport.rank + 1) % transport.size
    peer_from = (transport.rank - 1) % transport.size
    user = world.Isend([np.zeros(HEADER_SIZE, np.uint8), MPI.BYTE], peer_to, DATA_TAG)
    data = _payload(transport.rank, peer_to, 3)
    out = np.empty(3, dtype=np.uint8)
    reqs = [transport.irecv(peer_from, out.data, _header(3)),
            transport.isend(peer_to, data.data, _header(3))]
    _wait_all(reqs, _deadline())
    np.testing.assert_array_equal(out, _payload(peer_from, transport.rank, 3))
    junk = np.empty(HEADER_SIZE, np.uint8)
    world.Recv([junk, MPI.BYTE], peer_from, DATA_TAG)
    user.Wait()
    assert not junk.any()


@mpi
@pytest.mark.timeout(30)
def test_create_with_explicit_communicator() -> None:
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    # Split the world in two halves (size >= 2 ranks; a half may hold one rank).
    color = world.Get_rank() % 2
    sub = world.Split(color, world.Get_rank())
    try:
        with MPITransport.create(sub, timeout=TIMEOUT) as t:
            assert (t.rank, t.size) == (sub.Get_rank(), sub.Get_size())
            assert MPI.Comm.Compare(t.comm, sub) == MPI.CONGRUENT
            t.native_barrier(_deadline())
    finally:
        sub.Free()
    with pytest.raises(UsageError):
        MPITransport.create(timeout=0.0)


class FakeComm:
    """Not an mpi4py communicator."""


@mpi
@pytest.mark.timeout(30)
def test_create_rejects_what_is_not_an_mpi4py_communicator() -> None:
    from mpi4py import MPI

    with raises_usage("comm", match=r"got test_mpi_transport\.FakeComm"):  # names the type
        MPITransport.create(FakeComm(), timeout=TIMEOUT)
    with raises_usage("comm", match=r"got builtins\.object"):
        MPITransport.create(object(), timeout=TIMEOUT)
    with raises_usage("comm"):
        MPITransport.create(MPI.COMM_NULL, timeout=TIMEOUT)
    # Nothing was sent: a collective create still works on every rank.
    with MPITransport.create(timeout=TIMEOUT) as t:
        t.native_barrier(_deadline())


@mpi
@pytest.mark.timeout(30)
def test_create_on_a_user_split_then_frames() -> None:
    """A transport on the user's own sub-communicator (rank order reversed by the key)
    exchanges frames among the ranks of that communicator only."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    sub = world.Split(rank % 2, -rank)
    try:
        with MPITransport.create(sub, timeout=TIMEOUT) as t:
            members = sorted((r for r in range(world.Get_size()) if r % 2 == rank % 2),
                             reverse=True)
            assert (t.rank, t.size) == (members.index(rank), len(members))
            _ring_rounds(t, rounds=3, salt=7, who=lambda r: members[r])
    finally:
        sub.Free()


# --------------------------------------------------------------------------------------------
# Exchanges, ordering and counters
# --------------------------------------------------------------------------------------------


@mpi
@pytest.mark.timeout(60)
@pytest.mark.parametrize("length", LENGTHS)
def test_ring_exchange(transport: MPITransport, length: int) -> None:
    t = transport
    right, left = (t.rank + 1) % t.size, (t.rank - 1) % t.size
    data = _payload(t.rank, right, length)
    out = np.full(length, 0xAA, dtype=np.uint8)
    # Post the receive first on even ranks, the send first on odd ranks.
    if t.rank % 2 == 0:
        reqs = [t.irecv(left, out.data, _header(length)), t.isend(right, data.data,
                                                                 _header(length))]
    else:
        reqs = [t.isend(right, data.data, _header(length)), t.irecv(left, out.data,
                                                                    _header(length))]
    _wait_all(reqs, _deadline())
    assert all(r.done() for r in reqs)
    np.testing.assert_array_equal(out, _payload(left, t.rank, length))
    assert t.stats.snapshot() == {
        "bytes_sent": HEADER_SIZE + length, "bytes_received": HEADER_SIZE + length,
        "messages_sent": 1, "messages_received": 1,
    }
    assert t.failure is None


@mpi
@pytest.mark.timeout(60)
@pytest.mark.parametrize("length", [0, 1, 7, MIB])
def test_all_pairs_exchange(transport: MPITransport, length: int) -> None:
    """Every rank sends one frame to every other rank; lengths differ per pair."""
    t = transport

    def size_of(src: int, dst: int) -> int:
        return length + (src * 3 + dst) % 5 if length else 0

    outs: dict[int, npt.NDArray[np.uint8]] = {}
    reqs: list[Request] = []
    sends = []
    for peer in range(t.size):
        if peer == t.rank:
            continue
        n_in = size_of(peer, t.rank)
        outs[peer] = np.empty(n_in, dtype=np.uint8)
        reqs.append(t.irecv(peer, outs[peer].data, _header(n_in)))
    for peer in range(t.size):
        if peer == t.rank:
            continue
        data = _payload(t.rank, peer, size_of(t.rank, peer))
        sends.append(data)
        reqs.append(t.isend(peer, data.data, _header(data.nbytes)))
    _wait_all(reqs, _deadline())
    for peer, out in outs.items():
        np.testing.assert_array_equal(out, _payload(peer, t.rank, size_of(peer, t.rank)))
    peers = [p for p in range(t.size) if p != t.rank]
    assert t.stats.snapshot() == {
        "bytes_sent": sum(HEADER_SIZE + size_of(t.rank, p) for p in peers),
        "bytes_received": sum(HEADER_SIZE + size_of(p, t.rank) for p in peers),
        "messages_sent": len(peers),
        "messages_received": len(peers),
    }


@mpi
@pytest.mark.timeout(60)
def test_many_frames_in_flight_keep_their_order(transport: MPITransport) -> None:
    """Hundreds of frames of mixed sizes (inline and two-message) to both ring neighbours,
    all posted before any wait: each arrives intact, in order, in its own receive."""
    t = transport
    count = 150
    rng = np.random.default_rng(12345)  # same sizes on every rank
    sizes = rng.integers(0, 3 * INLINE_MAX, size=count)
    sizes[::10] = 0
    sizes[5::17] = 200_000
    neighbours = sorted({(t.rank + 1) % t.size, (t.rank - 1) % t.size})
    outs = {p: [np.empty(int(n), np.uint8) for n in sizes] for p in neighbours}
    reqs: list[Request] = []
    keep = []
    for i, n in enumerate(sizes):
        for p in neighbours:
            reqs.append(t.irecv(p, outs[p][i].data, _header(int(n), step=i)))
        for p in neighbours:
            data = _payload(t.rank, p, int(n), salt=i)
            keep.append(data)
            reqs.append(t.isend(p, data.data, _header(int(n), step=i)))
    _wait_all(reversed(reqs), _deadline(30.0))  # completion order does not matter
    for p in neighbours:
        for i, n in enumerate(sizes):
            np.testing.assert_array_equal(outs[p][i], _payload(p, t.rank, int(n), salt=i))
    total = sum(HEADER_SIZE + int(n) for n in sizes) * len(neighbours)
    assert t.stats.snapshot() == {
        "bytes_sent": total, "bytes_received": total,
        "messages_sent": count * len(neighbours), "messages_received": count * len(neighbours),
    }


@mpi
@pytest.mark.timeout(30)
def test_payloads_of_any_buffer_type(transport: MPITransport) -> None:
    """Payloads may be any C-contiguous buffer (2-D float arrays, bytes); sends may be
    read-only."""
    t = transport
    right, left = (t.rank + 1) % t.size, (t.rank - 1) % t.size
    data = np.arange(12, dtype=np.float64).reshape(3, 4) + t.rank
    data.flags.writeable = False
    out = np.zeros((3, 4), dtype=np.float64)
    reqs = [t.irecv(left, out.data, _header(out.nbytes)),
            t.isend(right, data.data, _header(data.nbytes))]
    _wait_all(reqs, _deadline())
    np.testing.assert_array_equal(out, np.arange(12).reshape(3, 4) + left)


@mpi
@pytest.mark.timeout(30)
def test_usage_errors_leave_the_transport_healthy(transport: MPITransport) -> None:
    t = transport
    buf = np.zeros(8, np.uint8)
    with pytest.raises(UsageError):
        t.isend(t.size, buf.data, _header(8))
    with pytest.raises(UsageError):
        t.irecv(-1, buf.data, _header(8))
    with pytest.raises(UsageError):
        t.isend(0, buf.data, _header(9))  # header length differs from the payload
    with pytest.raises(UsageError):
        t.irecv(0, memoryview(b"12345678"), _header(8))  # read-only receive buffer
    with pytest.raises(UsageError):
        t.isend(0, np.zeros((4, 4), np.uint8)[:, 1].data, _header(4))  # not contiguous
    assert t.failure is None
    assert t.stats.snapshot()["messages_sent"] == 0


# --------------------------------------------------------------------------------------------
# Failures: mismatches, truncation, timeouts, aborts
# --------------------------------------------------------------------------------------------


@mpi
@pytest.mark.timeout(60)
@pytest.mark.parametrize(("sent", "expected", "wrong_signature"), [
    (7, 7, True),
    (MIB, MIB, True),
    (8, 7, False),
    (7, MIB, False),
    (MIB, 7, False),
    (MIB + 1, MIB, False),
])
def test_header_mismatch_fails_every_rank(transport: MPITransport, sent: int, expected: int,
                                          wrong_signature: bool) -> None:
    """Rank 1 sends its right neighbour a frame with a wrong signature or length: the
    receiver gets ProtocolError, every other rank PeerLostError promptly."""
    t = transport
    right, left = (t.rank + 1) % t.size, (t.rank - 1) % t.size
    bad_sender, victim = 1, 2 % t.size
    n_send = sent if t.rank == bad_sender else expected
    sig = SIG + 1 if (t.rank == bad_sender and wrong_signature) else SIG
    data = _payload(t.rank, right, n_send)
    out = np.empty(expected, dtype=np.uint8)
    recv = t.irecv(left, out.data, _header(expected))
    send = t.isend(right, data.data, _header(n_send, sig=sig))
    # Everybody has posted before anybody looks at a frame (and the victim aborts). A plain
    # MPI barrier: the transport's own would race with the abort.
    _world_barrier()
    if t.rank == victim:
        start = time.monotonic()
        with pytest.raises(ProtocolError) as info:
            recv.wait(_deadline())
        assert time.monotonic() - start < PROMPT
        text = str(info.value)
        assert (info.value.peer, info.value.sequence) == (bad_sender, 1)
        if not wrong_signature:
            assert f"sent {sent} payload bytes" in text and str(expected) in text
        assert t.failure is info.value
        with pytest.raises(ProtocolError):
            t.isend(right, data.data, _header(n_send))
        with pytest.raises(ProtocolError):
            t.native_barrier(_deadline())
        t.abort("ignored: already failed")  # idempotent, keeps the first error
        assert t.failure is info.value
        assert t.finalize_risk is None  # a mismatch between live ranks
    else:
        # The healthy frames complete, unless the victim's abort overtakes them (a frame can
        # only complete while both ends still progress it): then they fail with the abort.
        for req in (recv, send):
            try:
                req.wait(_deadline())
            except PeerLostError as exc:
                assert f"rank {victim} aborted" in str(exc)
            else:
                if req is recv:
                    np.testing.assert_array_equal(out, _payload(left, t.rank, expected))
        _expect_peer_abort(t, victim, f"rank {victim} aborted")


@mpi
@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["payload", "header"])
@pytest.mark.parametrize("via", ["irecv", "stream"])
def test_truncation_becomes_protocol_error(transport: MPITransport, where: str,
                                           via: str) -> None:
    """A peer that sends more bytes than were posted (bypassing the transport) triggers MPI's
    truncation error, which must surface as ProtocolError, not an MPI crash, from a receive's
    wait and from a stream alike."""
    from mpi4py import MPI

    t = transport
    expected = 4 * INLINE_MAX
    victim, culprit = 0, 1
    if t.rank == victim:
        out = np.empty(expected, dtype=np.uint8)
        with pytest.raises(ProtocolError, match="longer than"):
            if via == "stream":
                plan = StreamPlan(out, out, "sum", t.size, [],
                                  [(_header(expected), 0, expected, MODE_LAND)])
                t.stream(culprit, culprit, plan, _deadline())
            else:
                t.irecv(culprit, out.data, _header(expected)).wait(_deadline())
        assert isinstance(t.failure, ProtocolError)
        assert t.finalize_risk is None  # MPI's truncation error: a mismatch, not a lost peer
    elif t.rank == culprit:
        comm = t.comm
        if where == "payload":
            # A correct header, then a payload twice as long as announced.
            messages = [_header(expected).pack(), np.zeros(2 * expected, np.uint8)]
        else:
            # A header message larger than any header + inline payload.
            big = np.zeros(HEADER_SIZE + INLINE_MAX + 100, np.uint8)
            _header(expected).pack_into(big.data)
            messages = [big]
        sends = [comm.Isend([m, MPI.BYTE], victim, DATA_TAG) for m in messages]
        _expect_peer_abort(t, victim, f"rank {victim} aborted")
        MPI.Request.Testall(sends)
    else:
        _expect_peer_abort(t, victim, f"rank {victim} aborted")


@mpi
@pytest.mark.timeout(60)
def test_unmatched_receive_times_out_near_its_deadline(transport: MPITransport) -> None:
    t = transport
    wait_for = 0.5
    buf = np.empty(16, dtype=np.uint8)
    req = t.irecv((t.rank + 1) % t.size, buf.data, _header(16))
    assert not req.done()
    start = time.monotonic()
    with pytest.raises(CommTimeoutError) as info:
        req.wait(start + wait_for)
    assert info.value.peer == (t.rank + 1) % t.size and info.value.sequence == 1
    elapsed = time.monotonic() - start
    assert elapsed >= wait_for  # not before its deadline
    assert t.failure is None  # a timeout alone does not abort the transport
    # ... but it bounds MPI_Finalize at exit (the peer might be stopped).
    assert t.finalize_risk is not None and "did not answer in time" in t.finalize_risk
    assert t.finalize_risk in mpi_lifecycle._FINALIZE_RISKS
    t.close()
    with pytest.raises(CommError):
        req.wait(_deadline())
    with pytest.raises(UsageError, match="closed"):
        t.irecv(0, buf.data, _header(16))
    t.close()  # idempotent


@mpi
@pytest.mark.timeout(60)
def test_abort_reaches_every_rank_promptly(transport: MPITransport) -> None:
    """Rank 0 aborts while everybody waits (rank 1 on a large send to rank 0, the others on
    a receive from rank 0): all fail within a second or so, long before the deadline, with
    the reason; rank 0's own pending request and later calls fail too."""
    t = transport
    marks = _shared_dir()
    if t.rank == 0:
        data = _payload(0, 1, MIB)
        pending = t.isend(1, data.data, _header(MIB))  # rank 1 never receives it
        _world_barrier()
        _await_marks(marks, list(range(1, t.size)))  # the others block in their waits
        shutil.rmtree(marks, ignore_errors=True)
        t.abort("out of cheese")
        failure = t.failure
        assert isinstance(failure, CommError)
        assert str(failure) == "rank 0 aborted: out of cheese"
        with pytest.raises(CommError, match="out of cheese"):
            pending.wait(_deadline())
        assert pending.done()
        with pytest.raises(CommError, match="out of cheese"):
            t.irecv(1, np.empty(4, np.uint8).data, _header(4))
        t.abort("again")  # idempotent: the first failure stays
        assert t.failure is failure
        assert t.finalize_risk is None  # an abort proves the peers alive
        return
    start = time.monotonic()
    if t.rank == 1:
        data = _payload(1, 0, MIB)
        req = t.isend(0, data.data, _header(MIB))  # rank 0 never receives it
    else:
        out = np.empty(MIB, np.uint8)
        req = t.irecv(0, out.data, _header(MIB))  # rank 0 never sends it
    _mark_when_waiting(os.path.join(marks, str(t.rank)))
    _world_barrier()
    with pytest.raises(PeerLostError) as info:
        req.wait(_deadline())
    assert time.monotonic() - start < PROMPT
    assert str(info.value) == "rank 0 aborted: out of cheese"
    _expect_peer_abort(t, 0, "rank 0 aborted: out of cheese")
    assert t.finalize_risk is None


@mpi
@pytest.mark.timeout(60)
def test_abort_during_native_collective(transport: MPITransport) -> None:
    t = transport
    x = np.ones(1000, dtype=np.float32)
    y = np.empty_like(x)
    marks = _shared_dir()
    if t.rank == t.size - 1:
        _await_marks(marks, list(range(t.size - 1)))  # the others are inside the collective
        shutil.rmtree(marks, ignore_errors=True)
        t.abort("not joining")
    else:
        _mark_when_waiting(os.path.join(marks, str(t.rank)))
        start = time.monotonic()
        with pytest.raises(PeerLostError, match="not joining"):
            t.native_allreduce(x, y, "sum", _deadline())
        assert time.monotonic() - start < PROMPT


@mpi
@pytest.mark.timeout(60)
def test_abort_during_persistent_allreduce(transport: MPITransport) -> None:
    """The checked all-reduce's persistent MPI all-reduce (made at the second call with the
    same arrays, started at the third) that one rank never starts: it joins the argument
    check with the bid of that request, then aborts. The others, waiting inside the
    persistent all-reduce, fail promptly with its reason; closing leaves their started
    request to MPI without hanging (the fixture closes)."""
    from bitcoll.transport.mpi.persistent import BID

    t = transport
    run = t.prepared_checked_allreduce(np.dtype(np.float32), 1000, "sum")
    x = np.ones(1000, dtype=np.float32)
    y = np.empty_like(x)
    for seq in range(3):  # a plain all-reduce, one that makes the request, one that starts it
        assert run(seq, SIG, x, y, _deadline())
        np.testing.assert_array_equal(y, float(t.size))
    assert t._persist._made == 1
    marks = _shared_dir()
    if t.rank == t.size - 1:
        records = t.prepared_records(BID.size)
        assert records(3, SIG, BID.pack(0, 1), _deadline())  # request 0, as the others bid
        _await_marks(marks, list(range(t.size - 1)))  # the others are inside the all-reduce
        shutil.rmtree(marks, ignore_errors=True)
        t.abort("not joining")
    else:
        # inside the wait of the all-reduce (a native collective named by a callable), not
        # the argument check's (named by a string)
        _mark_when_waiting(os.path.join(marks, str(t.rank)),
                           within=lambda f: f.f_code.co_name == "_await"
                           and callable(f.f_locals.get("what")))
        start = time.monotonic()
        with pytest.raises(PeerLostError, match="not joining"):
            run(3, SIG, x, y, _deadline())
        assert time.monotonic() - start < PROMPT


# --------------------------------------------------------------------------------------------
# Streams
# --------------------------------------------------------------------------------------------

_BIG = INLINE_MAX // 4 + 500  # float32 elements of a two-message frame
_SMALL = 7  # ... and of an inline one


def _stream_src(rank: int, dtype: str, salt: int) -> npt.NDArray[Any]:
    """Rank ``rank``'s contribution to the stream tests: a big block, a small one, room for
    the forwarded big block of its left neighbour."""
    return _rank_data(rank, 2 * _BIG + _SMALL, dtype, salt)


def _stream_schedule(fold_small: int) -> tuple[list[tuple[int, int, bool, int]],
                                              list[tuple[int, int, int]]]:
    """The frames of every rank, ring-shaped (to the right, from the left): its big block and
    its small one, then (forwarded once folded) the big block folded with the left
    neighbour's, then an empty frame; it folds the left neighbour's big block, treats the
    small one with ``fold_small``, lands the forwarded big block and the empty frame."""
    big, small, fwd = (0, _BIG), (_BIG, _BIG + _SMALL), (_BIG + _SMALL, 2 * _BIG + _SMALL)
    sends = [(*big, True, -1), (*small, True, -1), (*big, False, 0), (0, 0, True, -1)]
    recvs = [(*big, MODE_FOLD), (*small, fold_small), (*fwd, MODE_LAND), (0, 0, MODE_LAND)]
    return sends, recvs


def _stream_plan(t: MPITransport, work: npt.NDArray[Any], src: npt.NDArray[Any], op: str,
                 fold_small: int, seq: int = 1) -> StreamPlan:
    sends, recvs = _stream_schedule(fold_small)
    size = work.itemsize
    return StreamPlan(work, src, op, t.size,
                      [(_header((z - a) * size, step=i, seq=seq), a, z, f, after)
                       for i, (a, z, f, after) in enumerate(sends)],
                      [(_header((z - a) * size, step=j, seq=seq), a, z, mode)
                       for j, (a, z, mode) in enumerate(recvs)])


def _frame_by_frame(t: MPITransport, plan: StreamPlan, right: int, left: int) -> None:
    """What a rank that does not stream sends and receives for ``plan``: the same frames, one
    isend / irecv each, folded with numpy."""
    work, src = plan.work, plan.src
    ufunc = {"sum": np.add, "max": np.maximum, "min": np.minimum}[plan.op]
    lands = [np.empty(z - a, work.dtype) if mode != MODE_LAND else work[a:z]
             for _, a, z, mode in plan.recvs]
    recvs = [t.irecv(left, land.data, h) for land, (h, *_) in zip(lands, plan.recvs, strict=True)]

    def finish(j: int) -> None:
        _, a, z, mode = plan.recvs[j]
        recvs[j].wait(_deadline())
        if mode != MODE_LAND:
            ufunc(src[a:z], lands[j], out=work[a:z])
            if mode == MODE_FOLD_DIVIDE:
                np.divide(work[a:z], np.asarray(plan.divisor, work.dtype), out=work[a:z])

    sends: list[Request] = []
    done = 0
    for h, a, z, from_src, after in plan.sends:
        while after >= done:  # a forward: its receive first
            finish(done)
            done += 1
        sends.append(t.isend(right, (src if from_src else work)[a:z].data, h))
    for j in range(done, len(recvs)):
        finish(j)
    _wait_all(sends, _deadline())


@mpi
@pytest.mark.timeout(60)
@pytest.mark.parametrize(("dtype", "op", "fold_small"), [
    ("float32", "sum", MODE_FOLD_DIVIDE), ("float64", "sum", MODE_FOLD),
    ("float16", "sum", MODE_FOLD_DIVIDE), ("float32", "max", MODE_FOLD),
    ("int32", "max", MODE_FOLD), ("uint8", "min", MODE_LAND)])
@pytest.mark.parametrize("frames_rank", [None, 0])
def test_stream_runs_the_frames_of_a_ring(transport: MPITransport, dtype: str, op: str,
                                          fold_small: int, frames_rank: int | None) -> None:
    """Every rank streams a ring-shaped plan (two-message and inline frames, a forward of a
    folded block, an empty frame), or rank ``frames_rank`` makes the same frames one by one:
    folds, averages, landings and forwards as computed locally from the seeds, the traffic
    counted frame by frame, the transport healthy afterwards. Over MPI every fold streams
    (float16 and float max/min too: numpy folds them as the frame path does)."""
    t = transport
    assert t.stream_folds(np.dtype(dtype), op)
    right, left = (t.rank + 1) % t.size, (t.rank - 1) % t.size
    salt = 3 if frames_rank is None else 4
    src = _stream_src(t.rank, dtype, salt)
    work = np.zeros_like(src)
    plan = _stream_plan(t, work, src, op, fold_small)
    if t.rank == frames_rank:
        _frame_by_frame(t, plan, right, left)
    else:
        assert t.streams and t.stream(right, left, plan, _deadline())
    ufunc = {"sum": np.add, "max": np.maximum, "min": np.minimum}[op]
    mine, theirs = src, _stream_src(left, dtype, salt)
    further = _stream_src((left - 1) % t.size, dtype, salt)
    big, small = slice(0, _BIG), slice(_BIG, _BIG + _SMALL)
    np.testing.assert_array_equal(work[big], ufunc(mine[big], theirs[big]))
    if fold_small == MODE_LAND:
        want_small = theirs[small]
    else:
        want_small = ufunc(mine[small], theirs[small])
        if fold_small == MODE_FOLD_DIVIDE:
            want_small = want_small / np.asarray(t.size, src.dtype)
    np.testing.assert_array_equal(work[small], want_small)
    np.testing.assert_array_equal(work[_BIG + _SMALL:], ufunc(theirs[big], further[big]))
    stats = t.stats.snapshot()
    nbytes = (2 * _BIG + _SMALL) * src.itemsize + 4 * HEADER_SIZE
    assert stats["messages_sent"] == stats["messages_received"] == 4
    assert stats["bytes_sent"] == stats["bytes_received"] == nbytes
    assert t.failure is None
    _ring_rounds(t, 2, salt=5)  # frames go on as usual


@mpi
@pytest.mark.timeout(30)
def test_stream_rejects_a_forward_of_a_missing_receive(transport: MPITransport) -> None:
    t = transport
    work = np.zeros(4, np.uint8)
    plan = StreamPlan(work, work, "sum", t.size, [(_header(4), 0, 4, False, 0)], [])
    with raises_usage("plan"):  # (a send forwards a receive it does not have)
        t.stream((t.rank + 1) % t.size, (t.rank - 1) % t.size, plan, _deadline())
    assert t.failure is None and t.stats.snapshot()["messages_sent"] == 0


@mpi
@pytest.mark.timeout(60)
@pytest.mark.parametrize(("sent", "expected", "wrong_signature"), [
    (7, 7, True), (MIB, MIB, True), (MIB + 1, MIB, False), (8, 7, False)])
def test_stream_header_mismatch_fails_every_rank(transport: MPITransport, sent: int,
                                                 expected: int, wrong_signature: bool) -> None:
    """Rank 1 sends rank 0 a frame with a wrong signature or length while rank 0 streams:
    ProtocolError on rank 0 naming the peer and the collective, its transport failed; every
    other rank learns of it promptly."""
    t = transport
    victim, culprit = 0, 1
    if t.rank == victim:
        work = np.zeros(expected, np.uint8)
        plan = StreamPlan(work, work, "sum", t.size, [],
                          [(_header(expected, seq=7), 0, expected, MODE_LAND)])
        start = time.monotonic()
        with pytest.raises(ProtocolError) as info:
            t.stream(culprit, culprit, plan, _deadline())
        assert time.monotonic() - start < PROMPT
        if not wrong_signature:
            assert f"sent {sent} payload bytes" in str(info.value)
        assert info.value.peer == culprit and info.value.sequence == 7
        assert t.failure is info.value
        with pytest.raises(ProtocolError):
            t.stream(culprit, culprit, plan, _deadline())
    elif t.rank == culprit:
        data = _payload(culprit, victim, sent)
        sig = SIG + 1 if wrong_signature else SIG
        send = t.isend(victim, data.data, _header(sent, seq=7, sig=sig))
        _expect_peer_abort(t, victim, f"rank {victim} aborted")
        assert send.done()
    else:
        _expect_peer_abort(t, victim, f"rank {victim} aborted")


@mpi
@pytest.mark.timeout(60)
def test_stream_times_out_and_fails_the_transport(transport: MPITransport) -> None:
    """Rank 0 streams frames rank 1 never sends: CommTimeoutError at the deadline naming the
    silent peer, and (unlike a frame's wait) the transport fails, so every peer hears of it;
    the stream's posted receives are cancelled, so the transport still closes cleanly."""
    t = transport
    if t.rank == 0:
        work = np.zeros(MIB, np.uint8)
        plan = StreamPlan(work, work, "sum", t.size, [],
                          [(_header(MIB), 0, MIB, MODE_LAND), (_header(8, step=1), 0, 8,
                                                              MODE_LAND)])
        wait_for = 0.5
        start = time.monotonic()
        with pytest.raises(CommTimeoutError) as info:
            t.stream(1, 1, plan, start + wait_for)
        assert time.monotonic() - start >= wait_for  # not before its deadline
        assert info.value.peer == 1 and info.value.sequence == 1
        assert info.value.silent is None  # MPI cannot tell whether rank 1 waits on another
        assert t.failure is info.value
        assert t.finalize_risk is not None
        t.close()
        with pytest.raises(UsageError, match="closed"):
            t.stream(1, 1, plan, _deadline())
    else:
        _expect_peer_abort(t, 0, "rank 0 aborted")


@mpi
@pytest.mark.timeout(60)
def test_stream_fails_promptly_when_a_peer_aborts(transport: MPITransport) -> None:
    """Rank 1 aborts while rank 0 streams frames it will never get: PeerLostError with the
    reason, long before the deadline."""
    t = transport
    marks = _shared_dir()
    if t.rank == 0:
        work = np.zeros(MIB, np.uint8)
        src = _payload(0, 1, MIB)
        plan = StreamPlan(work, src, "sum", t.size, [(_header(MIB), 0, MIB, True, -1)],
                          [(_header(MIB), 0, MIB, MODE_LAND)])
        _mark_when_waiting(os.path.join(marks, "0"))
        start = time.monotonic()
        with pytest.raises(PeerLostError, match="rank 1 aborted: gone fishing"):
            t.stream(1, 1, plan, _deadline())
        assert time.monotonic() - start < PROMPT
        assert t.finalize_risk is None
    elif t.rank == 1:
        _await_marks(marks, [0])  # rank 0 is inside its stream, backing off
        shutil.rmtree(marks, ignore_errors=True)
        t.abort("gone fishing")
    else:
        _expect_peer_abort(t, 1, "rank 1 aborted: gone fishing")


# --------------------------------------------------------------------------------------------
# Native collectives
# --------------------------------------------------------------------------------------------


def _rank_data(rank: int, n: int, dtype: str, salt: int = 0) -> npt.NDArray[Any]:
    rng = np.random.default_rng([rank, n, salt])
    if np.dtype(dtype).kind == "f":
        return rng.standard_normal(n).astype(dtype)
    info = np.iinfo(dtype)
    lo, hi = max(info.min, -100), min(info.max, 100)
    return rng.integers(lo, hi, size=n, endpoint=True).astype(dtype)


def _reference(op: str, arrays: list[npt.NDArray[Any]]) -> npt.NDArray[Any]:
    stacked = np.stack(arrays)
    result: npt.NDArray[Any]
    if op == "sum":
        result = stacked.sum(axis=0, dtype=stacked.dtype)
    else:
        result = stacked.max(axis=0) if op == "max" else stacked.min(axis=0)
    return result


def _check_reduced(got: npt.NDArray[Any], want: npt.NDArray[Any]) -> None:
    if got.dtype.kind == "f":
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    else:
        np.testing.assert_array_equal(got, want)


@mpi
@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", ["float32", "float64", "int32", "uint8", "int64"])
@pytest.mark.parametrize("op", ["sum", "max", "min"])
def test_native_allreduce(transport: MPITransport, dtype: str, op: str) -> None:
    t = transport
    n = 1001
    send = _rank_data(t.rank, n, dtype)
    recv = np.empty_like(send)
    t.native_allreduce(send, recv, op, _deadline())
    want = _reference(op, [_rank_data(r, n, dtype) for r in range(t.size)])
    _check_reduced(recv, want)
    # In place: send and recv are the same array.
    t.native_allreduce(send, send, op, _deadline())
    _check_reduced(send, want)
    empty = np.empty(0, dtype=dtype)
    t.native_allreduce(empty, np.empty_like(empty), op, _deadline())
    assert t.stats.snapshot()["messages_sent"] == 0  # native traffic is not counted as frames


@mpi
@pytest.mark.timeout(60)
def test_native_extremes_equal_and_differing_values(transport: MPITransport) -> None:
    """Every rank gets the largest and smallest of each value; equal values give hi == lo;
    a differing lane shows up on every rank; ranks may pass different numbers of values (the
    message has a fixed size), and the transport stays usable."""
    t = transport
    hi, lo = t.native_extremes((5, -(1 << 62), 1 << 40), _deadline())
    assert hi.tolist() == lo.tolist() == [5, -(1 << 62), 1 << 40]
    hi, lo = t.native_extremes((1, 10 * t.rank, 3), _deadline())
    assert hi.tolist() == [1, 10 * (t.size - 1), 3]
    assert lo.tolist() == [1, 0, 3]
    k = 2 if t.rank == 0 else 3  # a rank passing fewer values reads as zeros in the rest
    hi, lo = t.native_extremes((7, 8, 9)[:k], _deadline())
    assert hi[:2].tolist() == lo[:2].tolist() == [7, 8]
    assert t.failure is None


@mpi
@pytest.mark.timeout(60)
def test_native_extremes_rejects_bad_values(transport: MPITransport) -> None:
    """Bad values are a UsageError before anything is sent (every rank passes the same bad
    values here, so no rank waits)."""
    t = transport
    with raises_usage("values"):
        t.native_extremes((), _deadline())
    with raises_usage("values"):
        t.native_extremes(tuple(range(17)), _deadline())
    with raises_usage("values"):
        t.native_extremes((1 << 64,), _deadline())
    assert t.failure is None
    assert t.reducible(np.dtype(np.float32), "sum")
    assert not t.reducible(np.dtype(np.float16), "sum")
    assert not t.reducible(np.dtype(np.complex64), "max")


@mpi
@pytest.mark.timeout(60)
@pytest.mark.parametrize(("dtype", "op"), [("float32", "sum"), ("int16", "max"),
                                           ("uint32", "min")])
def test_native_reduce_scatter(transport: MPITransport, dtype: str, op: str) -> None:
    t = transport
    n = 1000 + t.size - 1
    counts = [stop - start for start, stop in partition(n, t.size)]
    start, stop = partition(n, t.size)[t.rank]
    send = _rank_data(t.rank, n, dtype)
    recv = np.empty(counts[t.rank], dtype=dtype)
    t.native_reduce_scatter(send, recv, counts, op, _deadline())
    want = _reference(op, [_rank_data(r, n, dtype) for r in range(t.size)])
    _check_reduced(recv, want[start:stop])


@mpi
@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", ["float16", "bool", "int8"])
def test_native_data_movement(transport: MPITransport, dtype: str) -> None:
    """allgather, bcast and alltoall move bytes: any dtype works, float16 included."""
    t = transport
    p = t.size

    def data(rank: int, n: int, salt: int) -> npt.NDArray[Any]:
        rng = np.random.default_rng([rank, n, salt])
        return (rng.integers(-50, 50, size=n) if dtype != "bool"
                else rng.integers(0, 2, size=n)).astype(dtype)

    send = data(t.rank, 13, 1)
    gathered = np.empty(13 * p, dtype=dtype)
    t.native_allgather(send, gathered, _deadline())
    np.testing.assert_array_equal(gathered, np.concatenate([data(r, 13, 1) for r in range(p)]))

    root = p - 1
    buf = data(t.rank, 37, 2) if t.rank == root else np.zeros(37, dtype=dtype)
    buf.flags.writeable = t.rank != root  # the root's buffer is only read
    t.native_bcast(buf, root, _deadline())
    np.testing.assert_array_equal(buf, data(root, 37, 2))

    send = data(t.rank, 5 * p, 3)
    recv = np.empty_like(send)
    t.native_alltoall(send, recv, _deadline())
    want = np.concatenate([data(r, 5 * p, 3)[5 * t.rank:5 * (t.rank + 1)] for r in range(p)])
    np.testing.assert_array_equal(recv, want)
    t.native_barrier(_deadline())


@mpi
@pytest.mark.timeout(30)
def test_native_usage_errors(transport: MPITransport) -> None:
    t = transport
    x16 = np.ones(8, dtype=np.float16)
    with raises_usage("send"):
        t.native_allreduce(x16, np.empty_like(x16), "sum", _deadline())
    xb = np.ones(8, dtype=bool)
    with pytest.raises(UsageError):
        t.native_allreduce(xb, np.empty_like(xb), "max", _deadline())
    xc = np.ones(8, dtype=np.complex64)
    with raises_usage("send"):
        t.native_allreduce(xc, np.empty_like(xc), "max", _deadline())
    xl = np.ones(8, dtype=np.longdouble)
    with pytest.raises(UsageError):
        t.native_allreduce(xl, np.empty_like(xl), "sum", _deadline())
    xs = np.ones(8, dtype=">f4")
    with raises_usage("send"):
        t.native_allreduce(xs, np.empty_like(xs), "sum", _deadline())
    x = np.ones(8, dtype=np.float32)
    with pytest.raises(UsageError):
        t.native_allreduce(x, np.empty_like(x), "avg", _deadline())
    with pytest.raises(UsageError):
        t.native_allreduce(x, np.empty(9, np.float32), "sum", _deadline())
    with pytest.raises(UsageError):
        t.native_allreduce(x, np.empty(8, np.float64), "sum", _deadline())
    with pytest.raises(UsageError):
        t.native_allreduce(x[::2], np.empty(4, np.float32), "sum", _deadline())
    with raises_usage("recv"):  # (it overlaps send)
        t.native_allreduce(x[1:], x[:-1], "sum", _deadline())
    with pytest.raises(UsageError):
        t.native_reduce_scatter(x, np.empty(8, np.float32), [8] * (t.size + 1), "sum",
                                _deadline())
    with pytest.raises(UsageError):
        t.native_allgather(x, np.empty(8 * t.size + 1, np.float32), _deadline())
    with pytest.raises(UsageError):
        t.native_bcast(x, t.size, _deadline())
    with pytest.raises(UsageError):
        t.native_alltoall(np.ones(t.size + 1, np.float32), np.empty(t.size + 1, np.float32),
                          _deadline())
    # Nothing was started: the transport still works collectively.
    t.native_barrier(_deadline())
    assert t.failure is None


@mpi
@pytest.mark.timeout(60)
def test_native_collective_times_out(transport: MPITransport) -> None:
    """A collective that rank 0 never joins times out on the other ranks, near the deadline.
    (MPI cannot cancel a collective: the transport is left to be aborted or closed.)"""
    t = transport
    if t.rank != 0:
        start = time.monotonic()
        with pytest.raises(CommTimeoutError, match="native barrier"):
            t.native_barrier(start + 0.5)
        assert time.monotonic() - start >= 0.5  # not before its deadline
        assert t.finalize_risk is not None


@mpi
@pytest.mark.timeout(30)
def test_wait_does_not_burn_a_core(transport: MPITransport) -> None:
    """A rank waiting for a frame that comes late sleeps instead of spinning: it uses a small
    fraction of one core while it waits. (Rank 0 starts a token round the ring 0.6 s after
    every other rank is inside its wait.)"""
    t = transport
    right, left = (t.rank + 1) % t.size, (t.rank - 1) % t.size
    token = np.ones(1, np.uint8)
    out = np.empty(1, np.uint8)
    marks = _shared_dir()
    req = t.irecv(left, out.data, _header(1))
    if t.rank == 0:
        _await_marks(marks, list(range(1, t.size)))
        shutil.rmtree(marks, ignore_errors=True)
        time.sleep(0.6)  # how long the others wait (they are all waiting already)
        _wait_all([t.isend(right, token.data, _header(1)), req], _deadline())
        return
    _mark_when_waiting(os.path.join(marks, str(t.rank)))
    cpu0, wall0 = time.process_time(), time.monotonic()
    req.wait(_deadline())
    cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
    t.isend(right, token.data, _header(1)).wait(_deadline())
    assert wall >= 0.6
    assert cpu < 0.25 * wall, f"waited {wall:.2f} s using {cpu:.2f} s of CPU"


@mpi
@pytest.mark.timeout(30)
def test_close_is_idempotent_and_frees_the_communicator() -> None:
    from mpi4py import MPI

    t = MPITransport.create(timeout=TIMEOUT)
    comm = t.comm
    t.native_barrier(_deadline())
    t.close()
    t.close()
    assert comm == MPI.COMM_NULL  # mpi4py resets the handle of a freed communicator
    assert t.failure is None
    with pytest.raises(UsageError):
        t.native_barrier(_deadline())


@mpi
@pytest.mark.timeout(30)
def test_reduction_types_agree_with_dtlib(transport: MPITransport) -> None:
    """The reduction table names fixed-width types where ``mpi4py.util.dtlib`` picks C types
    (int8 -> MPI_SIGNED_CHAR, ...): same sizes; the dtypes MPI cannot reduce (float16, bool)
    stay out of it, although dtlib maps them."""
    from mpi4py import MPI
    from mpi4py.util import dtlib

    sums, maxes = mpi_module._reduce_table(MPI, "sum"), mpi_module._reduce_table(MPI, "max")
    assert set(sums) - set(maxes) == {"complex64", "complex128"}
    assert not {"float16", "bool", "longdouble"} & set(sums)
    for name, mpitype in sums.items():
        dup = dtlib.from_numpy_dtype(np.dtype(name))  # a new datatype on every call
        try:
            assert dup.Get_size() == mpitype.Get_size() == np.dtype(name).itemsize, name
        finally:
            dup.Free()
    # Sums of float16 and bool (which dtlib would map to MPIX_C_FLOAT16 / MPI_C_BOOL) still
    # raise before anything is sent.
    for dtype in ("float16", "bool"):
        x = np.ones(4, dtype=dtype)
        with raises_usage("send"):
            transport.native_allreduce(x, np.empty_like(x), "sum", _deadline())
    transport.native_barrier(_deadline())


# --------------------------------------------------------------------------------------------
# Sub-communicators: split
# --------------------------------------------------------------------------------------------


@mpi3
@pytest.mark.timeout(60)
def test_split_by_parity(transport: MPITransport) -> None:
    from mpi4py import MPI

    t = transport
    color = t.rank % 2
    members = sorted((r for r in range(t.size) if r % 2 == color), reverse=True)
    sub = t.split(color, key=-t.rank)  # reversed rank order inside each group
    assert sub is not None
    try:
        assert (sub.rank, sub.size) == (members.index(t.rank), len(members))
        assert (sub.timeout, sub.oversubscribed) == (t.timeout, t.oversubscribed)
        assert MPI.Comm.Compare(sub.comm, t.comm) == MPI.UNEQUAL
        assert sub.comm.Get_errhandler() == MPI.ERRORS_RETURN
        assert sub.failure is None and sub.finalize_risk is None
        x = np.array([t.rank], np.int64)
        y = np.empty_like(x)
        sub.native_allreduce(x, y, "sum", _deadline())
        assert int(y[0]) == sum(members)
        _ring_rounds(sub, rounds=4, salt=1, who=lambda r: members[r])
        assert sub.stats.snapshot()["messages_sent"] == 4
        assert t.stats.snapshot()["messages_sent"] == 0  # counters are per transport
    finally:
        sub.close()
    assert t.failure is None
    _ring_rounds(t, rounds=2, salt=2)  # the parent is untouched


@mpi3
@pytest.mark.timeout(60)
def test_split_color_none_stays_out(transport: MPITransport) -> None:
    t = transport
    outside = t.rank == t.size - 1
    sub = t.split(None if outside else 5, key=0)
    if outside:
        assert sub is None
    else:
        assert sub is not None
        try:
            assert (sub.rank, sub.size) == (t.rank, t.size - 1)  # key ties: parent order
            _ring_rounds(sub, rounds=4, salt=3)
        finally:
            sub.close()
    t.native_barrier(_deadline())


@mpi3
@pytest.mark.timeout(120)
def test_sibling_splits_from_several_threads_do_not_mix(transport: MPITransport) -> None:
    """Two splits by parity (one in rank order, one reversed: distinct communicators over the
    same groups) and the parent run ring rounds at the same time from three threads, with
    identical frame headers: every frame lands in its own transport."""
    t = transport
    color = t.rank % 2
    forward = sorted(r for r in range(t.size) if r % 2 == color)
    backward = forward[::-1]
    a = t.split(color, key=t.rank)
    b = t.split(color, key=-t.rank)
    assert a is not None and b is not None
    errors: list[BaseException] = []

    def work(tr: MPITransport, salt: int, who: Callable[[int], int]) -> None:
        try:
            _ring_rounds(tr, rounds=40, salt=salt, who=who)
        except BaseException as exc:
            errors.append(exc)
            tr.abort(f"thread failed: {exc!r}")  # the peers fail at once instead of waiting

    threads = [threading.Thread(target=work, args=(a, 11, lambda r: forward[r])),
               threading.Thread(target=work, args=(b, 12, lambda r: backward[r]))]
    try:
        for th in threads:
            th.start()
        work(t, 13, lambda r: r)
        for th in threads:
            th.join(timeout=60)
        assert not any(th.is_alive() for th in threads)
        assert not errors, errors
        for tr in (a, b):
            assert tr.failure is None
            assert tr.stats.snapshot()["messages_received"] == 40
        assert t.stats.snapshot()["messages_received"] == 40
    finally:
        a.close()
        b.close()


@mpi3
@pytest.mark.timeout(30)
def test_split_usage_errors(transport: MPITransport) -> None:
    t = transport
    for color in (-1, 1.5, "0", True):
        with raises_usage("color"):
            t.split(color)  # type: ignore[arg-type]
    with raises_usage("key"):
        t.split(0, key="a")  # type: ignore[arg-type]
    assert t.failure is None
    t.native_barrier(_deadline())  # nothing was sent
    closed = MPITransport.create(timeout=TIMEOUT)
    closed.close()
    with pytest.raises(UsageError, match="closed"):
        closed.split(0)


@mpi3
@pytest.mark.timeout(60)
def test_split_times_out_when_a_rank_stays_away() -> None:
    """Rank 0 never calls split: the others raise CommTimeoutError at the transport's
    deadline instead of hanging in MPI_Comm_split, and record a finalize risk."""
    t = MPITransport.create(timeout=1.0)
    try:
        if t.rank != 0:
            start = time.monotonic()
            with pytest.raises(CommTimeoutError, match="barrier before split"):
                t.split(0)
            assert time.monotonic() - start >= 1.0  # not before its deadline
            assert t.finalize_risk is not None and "did not answer" in t.finalize_risk
        else:
            assert t.finalize_risk is None
        _world_barrier()  # rank 0 waits here until the others timed out
    finally:
        t.close()


# --------------------------------------------------------------------------------------------
# The exception hook (the real thing, with MPI_Abort, is in test_mpi_failures.py)
# --------------------------------------------------------------------------------------------


@mpi
@pytest.mark.timeout(30)
def test_excepthook_prints_tells_the_peers_then_aborts(transport: MPITransport,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 runs the hook with MPI_Abort replaced: it chains to the previous hook, sends
    an abort notice naming the exception over every open transport (here: this one only),
    then asks for MPI_Abort(1), or 130 for KeyboardInterrupt."""
    t = transport
    assert mpi_lifecycle._hook_installed
    aborts: list[int] = []
    printed: list[tuple[object, ...]] = []
    monkeypatch.setattr(mpi_lifecycle, "_LIVE", {t})
    monkeypatch.setattr(mpi_lifecycle, "_abort_world", aborts.append)
    monkeypatch.setattr(mpi_lifecycle, "_previous_excepthook", lambda *a: printed.append(a))
    if t.rank == 0:
        exc = ValueError("bad value")
        _world_barrier()
        mpi_lifecycle._excepthook(ValueError, exc, None)
        assert printed == [(ValueError, exc, None)]
        assert aborts == [1]
        assert str(t.failure) == "rank 0 aborted: uncaught ValueError: bad value"
        mpi_lifecycle._excepthook(KeyboardInterrupt, KeyboardInterrupt(), None)
        assert aborts == [1, 130]
        assert t.finalize_risk is None
    else:
        _world_barrier()
        _expect_peer_abort(t, 0, "rank 0 aborted: uncaught ValueError: bad value")
        assert not printed and not aborts


@mpi
@pytest.mark.timeout(60)
def test_record_exchange_contract_and_clean_close() -> None:
    """``exchange_records``: every rank gets every rank's payload in rank order and ``agree``
    says whether every header matched (the same answer everywhere); a payload too large is a
    UsageError before anything is sent; ``record_bytes`` follows ``record_bytes(size)``. A clean
    close frees the persistent request and the communicator (nothing leaked)."""
    from mpi4py import MPI

    t = MPITransport.create(timeout=TIMEOUT)
    p, r = t.size, t.rank
    assert t.record_bytes == mpi_module.record_bytes(p)
    assert [mpi_module.record_bytes(n) for n in (1, 2, 16, 32, 64, 256, 4096)] == \
        [512, 512, 512, 256, 128, 32, 32]
    room = t.record_bytes - 16
    for n in (0, 1, 7, room):
        mine = _payload(r, 0, n)
        agree, rows = t.exchange_records(n + 1, SIG, mine.data, _deadline())
        assert agree
        for src in range(p):
            np.testing.assert_array_equal(rows[src, :n], _payload(src, 0, n))
    # One rank's header differs: every rank is told (no payload this time).
    agree, _ = t.exchange_records(99, SIG + (r == p - 1), None, _deadline())
    assert not agree
    with raises_usage("payload"):
        t.exchange_records(100, SIG, np.zeros(room + 1, np.uint8).data, _deadline())
    persistent = t._rec_req
    leaked = len(mpi_lifecycle._LEAKED)
    t.close()
    assert len(mpi_lifecycle._LEAKED) == leaked
    if persistent is not None:  # MPI has persistent collectives: the request was freed
        assert persistent == MPI.REQUEST_NULL
