"""Communicator behaviour on the in-process transport (threads as ranks) and on one rank."""

from __future__ import annotations

import threading
from typing import Any, assert_type

import numpy as np
import pytest
from errcheck import raises_usage
from inproc import run_threads
from sweeps import dense_sweep, inplace_and_async

import bitcoll
from bitcoll.communicator import Communicator
from bitcoll.errors import CommError, CommTimeoutError, PeerLostError, ProtocolError, UsageError
from bitcoll.transport.base import HEADER_SIZE
from bitcoll.work import Work

SMALL = (0, 1, 7, 8, 9, 1000)
# With 24-byte segments each block of a 305-element vector is 3 segments or more, for every
# dtype and world size up to 5 (the time goes by the segment); 305 splits evenly over 5 ranks,
# unevenly over 2 to 4.
TINY_SEGMENT_LENGTHS = (0, 1, 7, 8, 9, 305)


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5])
def test_dense_sweep_threads(size: int) -> None:
    # Tiny segments exercise the multi-segment pipelines.
    res = run_threads(size, lambda c: dense_sweep(c, lengths=TINY_SEGMENT_LENGTHS),
                      segment_bytes=24)
    assert res[0] > 100


@pytest.mark.parametrize("size", [1, 3, 4])
def test_inplace_and_async_threads(size: int) -> None:
    run_threads(size, inplace_and_async)


def test_local_backend() -> None:
    with bitcoll.init("local") as comm:
        assert (comm.rank, comm.size, comm.backend) == (0, 1, "local")
        dense_sweep(comm, lengths=SMALL)
        inplace_and_async(comm)
        assert comm.stats.snapshot()["bytes_sent"] == 0



def test_async_op_overloads() -> None:
    """``async_op=True`` is typed (and is) a Work, the default the array; mypy checks the
    ``assert_type`` lines statically, the isinstance checks hold at run time."""
    with bitcoll.init("local") as comm:
        x = np.arange(5, dtype=np.float32)
        work = comm.allreduce(x, async_op=True)
        assert_type(work, Work[Any])
        assert isinstance(work, Work) and np.array_equal(work.wait(), x)
        assert_type(comm.barrier(async_op=True), Work[None])
        assert comm.barrier() is None
        bits = comm.packed_sign_allreduce(np.zeros(1, np.uint8), 5, async_op=True)
        assert_type(bits, Work[Any])
        assert isinstance(comm.sign_allreduce(x), np.ndarray)
        flag = bool(x[0])
        either = comm.allgather(x, async_op=flag)  # a bool known only at run time
        assert_type(either, Any)
        assert isinstance(either, np.ndarray)

def test_init_rejects_unknown_backend() -> None:
    with raises_usage("backend"):
        bitcoll.init("carrier-pigeon")


def test_closed_communicator_is_an_error() -> None:
    comm = bitcoll.init("local")
    comm.close()
    comm.close()
    with pytest.raises(UsageError, match="closed"):
        comm.allreduce(np.ones(3))


@pytest.mark.parametrize("call,argument", [
    (lambda c: c.allreduce([1.0, 2.0]), "x"),
    (lambda c: c.allreduce(np.ones(3, dtype=np.complex64)), "x"),
    (lambda c: c.allreduce(np.ones(3, dtype=bool)), "x"),
    (lambda c: c.allreduce(np.ones(3, np.int32), op="avg"), "op"),
    (lambda c: c.allreduce(np.ones(3), op="prod"), "op"),
    (lambda c: c.allreduce(np.ones(3), out=np.ones(4)), "out"),
    (lambda c: c.allreduce(np.ones(3), out=np.ones(3, np.float32)), "out"),
    (lambda c: c.allreduce(np.ones(4), out=np.ones((4, 2))[:, 0]), "out"),
    (lambda c: c.allreduce(np.ones(3), algorithm="butterfly"), "algorithm"),
    (lambda c: c.allreduce(np.ones(3), algorithm="native"), "algorithm"),
    (lambda c: c.allreduce(np.ones(3), timeout=0), "timeout"),
    (lambda c: c.allreduce(np.ones(3), timeout=float("nan")), "timeout"),
    (lambda c: c.broadcast(np.ones(3), root=1), "root"),
    (lambda c: c.broadcast(np.ones(3)[::2]), "x"),
    (lambda c: c.reduce_scatter(np.ones(3), out=np.ones(1)), "out"),
    (lambda c: (lambda b: c.allreduce(b[:-1], out=b[1:]))(np.ones(5)), "out"),
    (lambda c: c.sign_allreduce(np.ones(3), op="mean"), "op"),
    (lambda c: c.quantized_allreduce(np.ones(3, np.int8), 2, op="majority"), "op"),
    (lambda c: c.quantized_reduce_scatter(np.ones(3, np.int8), 2, op="max"), "op"),
])
def test_usage_errors_on_one_rank(call: object, argument: str) -> None:
    comm = bitcoll.init("local")
    with raises_usage(argument):
        call(comm)  # type: ignore[operator]
    # one rank: a usage error leaves the communicator usable
    assert comm.allreduce(np.ones(2))[0] == 1.0


@pytest.mark.parametrize("attr", ["segment_bytes", "packed_segment_bytes"])
@pytest.mark.parametrize("value", [0, -5, 1.5, True, "1M"])
def test_segment_sizes_are_checked(attr: str, value: object) -> None:
    comm = bitcoll.init("local")
    with raises_usage(attr):
        setattr(comm, attr, value)
    with raises_usage(attr):
        bitcoll.init("local", **{attr: value})  # type: ignore[arg-type]
    setattr(comm, attr, 100)
    assert getattr(comm, attr) == 100


def test_none_gives_the_packed_segment_back_to_the_planner() -> None:
    comm = bitcoll.init("local", packed_segment_bytes=4096)
    assert comm.packed_segment_bytes == 4096
    comm.packed_segment_bytes = None
    assert comm.packed_segment_bytes is None
    assert bitcoll.init("local").packed_segment_bytes is None
    with raises_usage("segment_bytes"):  # the dense segment has no planner's choice
        comm.segment_bytes = None  # type: ignore[assignment]


def test_read_only_out_is_an_error() -> None:
    out = np.zeros(3)
    out.flags.writeable = False
    with raises_usage("out"):  # (its only fault: it is read-only)
        bitcoll.init("local").allreduce(np.ones(3), out=out)


def test_alltoall_length_must_divide() -> None:
    def body(c: Communicator) -> None:
        c.alltoall(np.ones(3))

    with raises_usage("x"):
        run_threads(2, body, timeout=5)


def _expect_everywhere(size: int, fn: object, local_error: type, timeout: float = 5.0) -> None:
    """Run fn on every rank; each rank must raise: the offending one ``local_error``, the
    others a CommError other than CommTimeoutError (no rank waits for its deadline)."""
    outcomes: list[tuple[type, str]] = [(type(None), "")] * size

    def body(c: Communicator) -> None:
        try:
            fn(c)  # type: ignore[operator]
        except Exception as exc:
            outcomes[c.rank] = (type(exc), str(exc))
        with pytest.raises(CommError):
            c.allreduce(np.ones(1))  # aborted for good

    run_threads(size, body, timeout=30)
    kinds = [k for k, _ in outcomes]
    assert local_error in kinds, outcomes
    assert all(issubclass(k, (CommError, local_error)) for k in kinds), outcomes
    assert not any(issubclass(k, CommTimeoutError) for k in kinds), outcomes


@pytest.mark.parametrize("size", [2, 3, 5])
def test_mismatched_length_raises_everywhere(size: int) -> None:
    _expect_everywhere(size, lambda c: c.allreduce(np.ones(10 + (c.rank == size - 1))),
                       ProtocolError)


@pytest.mark.parametrize("size", [2, 4])
def test_mismatched_dtype_raises_everywhere(size: int) -> None:
    _expect_everywhere(size, lambda c: c.allreduce(
        np.ones(5000, np.float32 if c.rank else np.float64)), ProtocolError)


def test_mismatched_collective_raises_everywhere() -> None:
    _expect_everywhere(3, lambda c: c.allgather(np.ones(4)) if c.rank == 1
                       else c.allreduce(np.ones(4)), ProtocolError)


def test_comm_errors_carry_rank_collective_and_sequence() -> None:
    """Every CommError leaving a collective says which rank, collective and call it was."""
    left_barrier = threading.Barrier(3)

    def body(c: Communicator) -> tuple[object, ...]:
        c.barrier()
        left_barrier.wait(10)  # nobody aborts call #1 while a rank is still in call #0
        try:
            c.allreduce(np.ones(10 + c.rank))  # call #1: lengths differ
        except CommError as exc:
            return (exc.rank, exc.collective, exc.sequence, type(exc).__name__)
        return ("no error",)

    got = run_threads(3, body, timeout=30)
    assert [g[:3] for g in got] == [(r, "allreduce", 1) for r in range(3)], got


def test_usage_error_on_one_rank_fails_the_others_fast() -> None:
    def body(c: Communicator) -> None:
        out = np.zeros(5 if c.rank == 1 else 4)
        c.allreduce(np.ones(4), out=out)

    _expect_everywhere(3, body, UsageError)


def test_deadline_raises_comm_timeout() -> None:
    timed_out = threading.Event()

    def body(c: Communicator) -> str:
        if c.rank == 0:
            try:
                c.allreduce(np.ones(4), timeout=0.3)
            except CommTimeoutError as exc:
                return type(exc).__name__
            finally:
                timed_out.set()
            return "no error"
        assert timed_out.wait(10)  # rank 1 joins only after rank 0 gave up
        try:
            c.allreduce(np.ones(4), timeout=2)
        except PeerLostError:
            return "lost"
        return "no error"

    assert run_threads(2, body, timeout=10) == ["CommTimeoutError", "lost"]


def test_work_wait_timeout_does_not_abort() -> None:
    timed_out = threading.Event()

    def body(c: Communicator) -> float:
        if c.rank == 1:
            assert timed_out.wait(10)  # joins only after rank 0's wait timed out
        w = c.allreduce(np.ones(2), async_op=True)
        if c.rank == 0:
            try:
                with pytest.raises(CommTimeoutError):
                    w.wait(timeout=0.01)
            finally:
                timed_out.set()
        return float(w.wait()[0])

    assert run_threads(2, body) == [2.0, 2.0]


def test_stats_count_headers_and_payload() -> None:
    def body(c: Communicator) -> dict[str, int]:
        c.stats.reset()
        c.allreduce(np.ones(8, np.float32), algorithm="ring")
        return c.stats.snapshot()

    for p in (2, 3, 4):
        for snap in run_threads(p, body):
            # two ring passes of p - 1 frames each; blocks of 8 float32 split p ways
            assert snap["messages_sent"] == snap["messages_received"] == 2 * (p - 1)
            assert snap["bytes_sent"] >= 2 * (p - 1) * HEADER_SIZE
            assert snap["bytes_sent"] <= 2 * (p - 1) * (HEADER_SIZE + 4 * (-(-8 // p)))
