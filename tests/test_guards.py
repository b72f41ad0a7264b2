"""No silent wrong results: in-place all-to-all, one thread at a time per communicator,
broadcast roots compared across ranks, argument types that look right but are not."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from errcheck import raises_usage
from inproc import run_threads
from multiproc import run_world

import bitcoll
from bitcoll.communicator import Communicator
from bitcoll.errors import BitcollError, CommError, ProtocolError, UsageError


def _alltoall_inplace(comm: Communicator) -> None:
    p, r = comm.size, comm.rank
    for m in (0, 1, 7, 8, 9, 1001):
        x = (np.arange(p * m, dtype=np.float64) + 1000 * r)
        expect = np.concatenate([np.arange(r * m, (r + 1) * m, dtype=np.float64) + 1000 * j
                                 for j in range(p)]) if m else np.empty(0)
        out = comm.alltoall(x, out=x)
        assert out is x
        np.testing.assert_array_equal(x, expect)
        y = (np.arange(p * m, dtype=np.int32) + 1000 * r)
        np.testing.assert_array_equal(comm.alltoall(y), expect.astype(np.int32))


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5])
def test_alltoall_in_place_threads(size: int) -> None:
    run_threads(size, _alltoall_inplace)


def test_alltoall_partial_overlap_is_refused() -> None:
    with bitcoll.init("local") as comm:
        z = np.zeros(4)
        with raises_usage("out"):  # (it overlaps x)
            comm.alltoall(z[:2], out=z[1:3])


def _alltoall_inplace_tcp(comm: Communicator) -> None:
    _alltoall_inplace(comm)


@pytest.mark.timeout(120)
def test_alltoall_in_place_tcp() -> None:
    run_world(3, _alltoall_inplace_tcp, timeout=100)


def _broadcast_roots(comm: Communicator) -> str:
    x = np.arange(5, dtype=np.float32) * (comm.rank + 1)
    root = 0 if comm.rank == 0 else 1
    try:
        comm.broadcast(x, root=root)
    except BitcollError as exc:
        if isinstance(exc, ProtocolError):  # the same finding as over MPI (test_fast_paths)
            assert exc.fields == ("root",) and exc.collective == "broadcast", exc
            assert str(exc).startswith(f"broadcast #{exc.sequence}: the ranks called it "
                                       "with different root"), exc
        return type(exc).__name__
    return "returned"


@pytest.mark.timeout(120)
def test_broadcast_roots_differ_is_a_protocol_error_everywhere() -> None:
    assert run_world(3, _broadcast_roots, timeout=100) == ["ProtocolError"] * 3
    assert run_threads_kinds(4) == ["ProtocolError"] * 4


def run_threads_kinds(size: int) -> list[str]:
    return run_threads(size, _broadcast_roots)


def test_broadcast_root_must_be_a_rank() -> None:
    with bitcoll.init("local") as comm:
        for bad in (True, 1.0, -1, 1, "0"):
            with raises_usage("root"):
                comm.broadcast(np.ones(3), root=bad)  # type: ignore[arg-type]


def test_big_endian_arrays_get_a_clear_message() -> None:
    with bitcoll.init("local") as comm, raises_usage("x", match="byte order"):
        comm.allreduce(np.ones(3, dtype=">f4"))


def test_second_thread_inside_a_collective_is_refused() -> None:
    """Thread A is inside an all-reduce on rank 0 (rank 1 has not called yet); thread B's call
    on rank 0 is refused at once and the communicator is aborted on both ranks."""
    inside = threading.Event()
    outcome: dict[str, str] = {}

    def rank_fn(comm: Communicator) -> None:
        if comm.rank == 1:
            inside.wait(20)  # join only once rank 0's second thread has tried
            try:
                comm.allreduce(np.ones(4))
            except CommError as exc:
                outcome["rank1"] = type(exc).__name__
            return

        def thread_a() -> None:
            try:
                comm.allreduce(np.ones(4))
            except CommError as exc:
                outcome["a"] = type(exc).__name__

        a = threading.Thread(target=thread_a, name="thread-a")
        a.start()
        deadline = time.monotonic() + 20
        while not comm._call_lock.locked() and time.monotonic() < deadline:
            time.sleep(0.001)  # wait for a condition, not for an interleaving
        try:
            comm.barrier()
        except UsageError as exc:
            outcome["b"] = str(exc)
        inside.set()
        a.join(20)

    run_threads(2, rank_fn, timeout=20)
    assert "thread-a" in outcome["b"] and "one thread at a time" in outcome["b"]
    assert outcome["a"] in ("CommError", "PeerLostError")
    assert outcome["rank1"] == "PeerLostError"


def _two_threads(comm: Communicator, calls: int) -> dict[str, int]:
    """Two threads x ``calls`` all-reduces of different lengths on one communicator: every
    call returns the right value or raises; none returns a wrong value."""
    counts = {"right": 0, "wrong": 0, "error": 0}
    lock = threading.Lock()

    def worker(t: int) -> None:
        x = np.full(8 * (t + 1), float(t + 1), np.float32)
        want = float((t + 1) * comm.size)
        for _ in range(calls):
            try:
                y = comm.allreduce(x, timeout=30)
            except BitcollError:
                with lock:
                    counts["error"] += 1
                continue
            with lock:
                counts["right" if (y == want).all() else "wrong"] += 1

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return counts


@pytest.mark.timeout(200)
def test_two_threads_thousand_calls_never_silently_wrong() -> None:
    for counts in run_world(2, _two_threads, 1000, timeout=180):
        assert counts["wrong"] == 0, counts
        assert counts["right"] + counts["error"] == 2000, counts


def _recreate(comm: Communicator, cycles: int) -> list[float]:
    """Close the communicator, then create and close ``cycles`` more in the same environment
    (same store address): each must meet its own generation of rank 0's store."""
    comm.close()
    sums = []
    for i in range(cycles):
        with bitcoll.init("tcp", timeout=60) as c2:
            sums.append(float(c2.allreduce(np.full(3, float(i + c2.rank)))[0]))
    return sums


@pytest.mark.timeout(300)
def test_twenty_create_close_cycles() -> None:
    res = run_world(3, _recreate, 20, timeout=280)
    for sums in res:
        assert sums == [3.0 * i + 3.0 for i in range(20)]


def test_protocol_error_is_a_comm_error() -> None:
    assert issubclass(ProtocolError, CommError)
