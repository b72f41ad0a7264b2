"""Automatic algorithm choice by size (the packed all-gather baseline for small vectors, MPI's
own all-reduce for small vectors over MPI, behind the argument check, and the smallest inside
the check's records) and MPI's own all-reduce refusing float16 before anything is sent."""

from __future__ import annotations

import numpy as np
import pytest
from errcheck import raises_usage
from inproc import run_threads

import bitcoll
from bitcoll.communicator import NATIVE_ALLREDUCE_MAX_BYTES, Communicator
from bitcoll.plan import DEFAULT_MODEL, Call, choose, group_of
from bitcoll.transport.base import HEADER_SIZE


def _default_bytes(comm: Communicator) -> list[int]:
    sent = []
    for n in (1000, 4_000_003):
        x = np.random.default_rng([comm.rank, n]).standard_normal(n).astype(np.float32)
        comm.barrier()
        comm.stats.reset()
        y = comm.sign_allreduce(x)
        snap = comm.stats.snapshot()
        overhead = getattr(comm.transport, "frame_overhead", HEADER_SIZE)
        sent.append(snap["bytes_sent"] - overhead * snap["messages_sent"])
        z = comm.sign_allreduce(x, algorithm="direct")
        np.testing.assert_array_equal(y, z)  # same votes whichever algorithm ran
    return sent


def test_packed_default_picks_by_size() -> None:
    p = 3
    for sent in run_threads(p, _default_bytes):
        assert sent[0] == (p - 1) * -(-1000 // 8)  # all-gather: the whole vector to each peer
        assert sent[1] < (p - 1) * 4_000_003 // 8  # direct: less than the all-gather


@pytest.mark.mpi(min_size=2)
def test_mpi_native_float16_is_refused_before_sending() -> None:
    # The UsageError aborts the communicator, so a peer may see its reason (PeerLostError)
    # instead, even while it is still creating the communicator: both happen inside the check.
    with pytest.raises((bitcoll.UsageError, bitcoll.PeerLostError), match="float16"), \
            bitcoll.init("mpi", timeout=60) as fresh:
        fresh.allreduce(np.ones(3, np.float16), algorithm="native")


def _mpi_ranks_data(rank: int, n: int, dtype: str) -> np.ndarray:
    rng = np.random.default_rng([rank, n])
    if np.dtype(dtype).kind == "f":
        return rng.standard_normal(n).astype(dtype)
    return rng.integers(-50, 50, n).astype(dtype)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_mpi_default_allreduce_is_native_up_to_the_threshold() -> None:
    """Over MPI the default all-reduce is MPI's own up to NATIVE_ALLREDUCE_MAX_BYTES (no
    bitcoll frames are sent: native traffic is not counted; a vector that fits the argument
    check's records travels inside it, float16 included) and bitcoll's own above it and for
    float16 beyond the records, which MPI cannot reduce; every rank gets the exact result
    (integers) and the same bits (floats) either way."""
    limit = NATIVE_ALLREDUCE_MAX_BYTES // 4
    with bitcoll.init("mpi", timeout=60) as comm:
        for n, dtype, native in [(0, "float32", True), (1, "int32", True),
                                 (9, "float64", True), (limit, "float32", True),
                                 (limit + 1, "float32", False), (9, "float16", True),
                                 (1000, "float16", False)]:
            x = _mpi_ranks_data(comm.rank, n, dtype)
            comm.barrier()
            comm.stats.reset()
            y = comm.allreduce(x, op="sum")
            frames = comm.stats.snapshot()["messages_sent"]
            assert (frames == 0) == native or n == 0, (n, dtype, frames)
            if dtype == "int32":
                want = sum(_mpi_ranks_data(r, n, dtype) for r in range(comm.size))
                np.testing.assert_array_equal(y, want)
            every = comm.allgather(y.reshape(1, -1) if n else y)
            for row in np.asarray(every).reshape(comm.size, -1):
                np.testing.assert_array_equal(row, y.reshape(-1))  # same bits everywhere
            avg = comm.allreduce(x, op="avg") if dtype != "int32" else None
            if avg is not None and n:
                np.testing.assert_allclose(avg, y / comm.size, rtol=1e-3, atol=1e-3)



def _check_reduction(comm: Communicator, y: np.ndarray, rows: list[np.ndarray], op: str) -> None:
    """``y`` is the all-reduce of ``rows`` (every rank's input) with ``op``: integers exactly,
    floats within float32 rounding of the float64 result, the same bits on every rank."""
    ufunc = {"sum": np.add, "avg": np.add, "max": np.maximum, "min": np.minimum}[op]
    if y.dtype.kind in "iu":
        np.testing.assert_array_equal(y, ufunc.reduce(np.stack(rows)))
    else:
        want = ufunc.reduce(np.stack(rows).astype(np.float64))
        if op == "avg":
            want = want / comm.size
        np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
    every = comm.allgather(y.reshape(1, -1))
    for row in np.asarray(every).reshape(comm.size, -1):
        np.testing.assert_array_equal(row, y)  # same bits everywhere


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_mpi_native_fast_path_in_place_and_shaped() -> None:
    """MPI's own all-reduce behind the fast path (vectors past the argument check's records):
    out of place, into a given ``out``, in place as a 1-D and as a 3-D array (one buffer, so
    MPI gets MPI_IN_PLACE) and with every op; integers exactly the sum / extreme over the
    ranks' seeded inputs, floats the same bits on every rank."""
    with bitcoll.init("mpi", timeout=60) as comm:
        room = comm._transport.record_bytes - 16  # type: ignore[attr-defined]
        for dtype in ("int32", "int64", "float32", "float64"):
            n = room // np.dtype(dtype).itemsize + 7
            rows = [_mpi_ranks_data(r, n, dtype) for r in range(comm.size)]
            for op in ("sum", "max", "min", "avg"):
                if op == "avg" and np.dtype(dtype).kind != "f":
                    continue
                x = rows[comm.rank].copy()
                comm.stats.reset()
                y = comm.allreduce(x, op=op)
                out = np.empty((1, n), dtype)
                assert comm.allreduce(x.reshape(n, 1), op=op, out=out) is out
                flat = x.copy()
                assert comm.allreduce(flat, op=op, out=flat) is flat
                cube = x.copy().reshape(1, n, 1)
                assert comm.allreduce(cube, op=op, out=cube) is cube
                assert comm.stats.snapshot()["messages_sent"] == 0, (dtype, op)  # all MPI's
                np.testing.assert_array_equal(x, rows[comm.rank])  # input untouched
                for got in (out.reshape(-1), flat, cube.reshape(-1)):
                    np.testing.assert_array_equal(got, y)
                _check_reduction(comm, y, rows, op)

def _made_everywhere(comm: Communicator, made: int) -> int:
    """``made`` (persistent all-reduces this rank made), checked to be the same on every rank."""
    every = comm.allgather(np.array([made], np.int64))
    assert (every == made).all(), every
    return made


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_mpi_native_persistent_allreduce_stays_in_step() -> None:
    """MPI's own all-reduce on arrays used again runs as a persistent MPI collective, made and
    started in step on every rank: the last rank alternating its ``out`` between two arrays
    makes every rank fall back to a plain all-reduce or make a new one (in the same calls: the
    count of made ones agrees), out of place, in place, 2-D, with avg's division, and with
    the strided general path on one rank; every result is the seeded reduction. A plan
    holds the arrays of its persistent all-reduce (numpy refuses to resize them in place:
    MPI keeps their address); more plans than a transport
    keeps (the oldest are freed) stay right; close frees them all."""
    from bitcoll.transport.mpi.persistent import PERSISTENT_ALLREDUCES

    with bitcoll.init("mpi", timeout=60) as comm:
        t = comm._transport
        persist = t._persist  # type: ignore[attr-defined]
        last = comm.rank == comm.size - 1
        n = (t.record_bytes - 16) // 4 + 9  # type: ignore[attr-defined]  # past the records
        for dtype, op in (("int32", "sum"), ("float64", "max"), ("float32", "avg")):
            rows = [_mpi_ranks_data(r, n, dtype) for r in range(comm.size)]
            x = rows[comm.rank].copy()
            out, other = np.empty_like(x), np.empty_like(x)
            want = comm.allreduce(x.copy(), op=op)  # new arrays: a plain all-reduce
            _check_reduction(comm, want, rows, op)
            before = persist._made
            for i in range(12):
                target = other if last and i % 3 == 2 else out
                assert comm.allreduce(x, op=op, out=target) is target
                np.testing.assert_array_equal(target, want)
            # calls 0, 2, 6, 8 plain (a new pair of arrays somewhere), 1, 5, 7, 11 make one,
            # 3, 4, 9, 10 start the one every rank holds
            assert _made_everywhere(comm, persist._made - before) == 4
            np.testing.assert_array_equal(x, rows[comm.rank])  # input untouched
            square = np.empty((1, n), x.dtype)  # owns its memory: numpy could resize it
            for _ in range(3):  # in place, 2-D: the same objects again
                np.copyto(square, x.reshape(1, n))
                assert comm.allreduce(square, op=op, out=square) is square
                np.testing.assert_array_equal(square.reshape(-1), want)
            strided = np.repeat(x, 2)[::2]
            for _ in range(3):  # the general path on one rank (its record has no bid)
                src = strided if last else x
                np.testing.assert_array_equal(comm.allreduce(src, op=op, out=out), want)
            with pytest.raises(ValueError, match="referenced"):
                square.resize(n + 1)  # held by the plan's persistent all-reduce
        spare = np.zeros((1, n), np.int32)
        spare.resize(n + 1)  # (numpy resizes an array nothing else holds)
        for k in range(PERSISTENT_ALLREDUCES + 6):
            v = np.full(n + k, comm.rank + k, np.int64)
            for _ in range(3):
                assert comm.allreduce(v, out=v) is v
                np.copyto(v, comm.rank + k)
        assert len(persist._live) <= PERSISTENT_ALLREDUCES
        first = np.full(n, comm.rank, np.int64)
        for _ in range(3):  # a plan whose persistent all-reduce was freed
            np.testing.assert_array_equal(comm.allreduce(first), comm.size * (comm.size - 1) // 2)
            assert comm.allreduce(first, out=first) is first
            np.testing.assert_array_equal(first, comm.size * (comm.size - 1) // 2)
            first[:] = comm.rank
        assert persist._live
    assert not persist._live and not persist.available


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_mpi_default_ring_fast_and_general_paths_agree() -> None:
    """Over MPI above NATIVE_ALLREDUCE_MAX_BYTES the default is bitcoll's algorithm the
    planner picks (the ring, streamed, or recursive doubling): the fast path (a contiguous
    vector, even ranks) and the general path (a strided view, odd ranks) pair up, as do that
    algorithm forced, a given ``out`` and an in-place call; integers are exactly the seeded
    reduction, floats the same bits on every rank and path."""
    with bitcoll.init("mpi", timeout=60) as comm:
        n = NATIVE_ALLREDUCE_MAX_BYTES // 4 + 9
        algo = choose("allreduce", comm.cost_model, comm.plan_group, Call(nbytes=4 * n))
        assert algo in ("ring", "recursive_doubling")
        for dtype in ("int32", "float32"):
            rows = [_mpi_ranks_data(r, n, dtype) for r in range(comm.size)]
            for op in ("sum", "max", "avg"):
                if op == "avg" and dtype == "int32":
                    continue
                mine = rows[comm.rank]
                x = np.repeat(mine, 2)[::2] if comm.rank % 2 else mine.copy()
                comm.stats.reset()
                y = comm.allreduce(x, op=op)
                assert comm.stats.snapshot()["messages_sent"] > 0  # bitcoll's frames
                forced = comm.allreduce(mine.copy(), op=op, algorithm=algo)
                out = np.empty((1, n), dtype)
                assert comm.allreduce(mine.reshape(n, 1), op=op, out=out) is out
                inplace = mine.copy()
                assert comm.allreduce(inplace, op=op, out=inplace) is inplace
                np.testing.assert_array_equal(mine, rows[comm.rank])  # input untouched
                for got in (forced, out.reshape(-1), inplace):
                    np.testing.assert_array_equal(got, y)
                _check_reduction(comm, y, rows, op)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("differ", ["straddle", "dtype", "op", "algorithm"])
def test_mpi_allreduce_mismatch_fails_every_rank_at_once(differ: str) -> None:
    """The last rank passes another length (on the other side of the native threshold), dtype,
    op or forced algorithm: the fixed-size argument check makes every rank raise
    ProtocolError naming what differs, long before the communicator's 300 s deadline."""
    with bitcoll.init("mpi", timeout=300) as comm:
        odd = comm.rank == comm.size - 1
        n = NATIVE_ALLREDUCE_MAX_BYTES // 4 + (1000 if differ == "straddle" and odd else 0)
        dtype = np.float64 if differ == "dtype" and odd else np.float32
        op = "max" if differ == "op" and odd else "sum"
        algorithm = "ring" if differ == "algorithm" and odd else None
        words = {"straddle": "element count", "dtype": "element type", "op": "op",
                 "algorithm": "algorithm"}
        with pytest.raises(bitcoll.ProtocolError) as info:
            comm.allreduce(np.ones(n, dtype), op=op, algorithm=algorithm)
        assert words[differ] in (info.value.fields or ())  # (the algorithm may differ too)
        assert info.value.sequence == 0 and info.value.collective == "allreduce"
        with pytest.raises(bitcoll.CommError):  # the communicator is unusable afterwards
            comm.allreduce(np.ones(2, np.float32))


def _rank_order(rows: list[np.ndarray], op: str) -> np.ndarray:
    """The inline all-reduce's result computed here: ``op`` over the rows in rank order, each
    step rounded in the dtype (avg: that sum divided by the number of rows)."""
    ufunc = {"sum": np.add, "avg": np.add, "max": np.maximum, "min": np.minimum}[op]
    acc = rows[0].copy()
    for row in rows[1:]:
        acc = ufunc(acc, row)
    if op == "avg":
        acc = acc / np.asarray(len(rows), dtype=acc.dtype)
    return acc


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_mpi_inline_allreduce_is_the_rank_order_reduction() -> None:
    """A vector that fits the argument check's records is reduced by every rank from the
    gathered records, in rank order: bit for bit the local rank-order reduction of every
    rank's seeded input, for every dtype, op and shape, lengths 0, 1, 7, 8, 9 and the last
    one that fits; out of place, in place, into a given ``out``, as async work and with a
    timeout (the general path) alike; nothing goes through bitcoll frames."""
    with bitcoll.init("mpi", timeout=60) as comm:
        room = comm._transport.record_bytes - 16  # type: ignore[attr-defined]
        for dtype in ("float16", "float32", "float64", "int8", "uint16", "int32", "int64"):
            fits = room // np.dtype(dtype).itemsize
            for n in sorted({0, 1, 7, 8, 9, fits}):
                for op in ("sum", "avg", "max", "min"):
                    if op == "avg" and np.dtype(dtype).kind != "f":
                        continue
                    rows = [_mpi_ranks_data(r, n, dtype) for r in range(comm.size)]
                    want = _rank_order(rows, op)
                    x = rows[comm.rank].copy()
                    comm.stats.reset()
                    np.testing.assert_array_equal(comm.allreduce(x, op=op), want)
                    shaped = x.reshape(1, n, 1)
                    out = np.empty((n,), dtype)
                    assert comm.allreduce(shaped, op=op, out=out) is out
                    np.testing.assert_array_equal(out, want)
                    work = comm.allreduce(x, op=op, async_op=True)
                    np.testing.assert_array_equal(work.wait(), want)
                    np.testing.assert_array_equal(comm.allreduce(x, op=op, timeout=30), want)
                    assert comm.allreduce(x, op=op, out=x) is x  # in place
                    np.testing.assert_array_equal(x, want)
                    assert comm.stats.snapshot()["messages_sent"] == 0, (dtype, n, op)
        # The first length past the records goes to MPI's own all-reduce: same sum, for
        # integers exactly.
        n = room // 4 + 1
        rows = [_mpi_ranks_data(r, n, "int32") for r in range(comm.size)]
        np.testing.assert_array_equal(comm.allreduce(rows[comm.rank]), sum(rows))


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_mpi_inline_allreduce_straddling_the_records_fails_every_rank() -> None:
    """The last rank's vector is one element too long for the records (MPI's all-reduce
    after the check) while the others' fit (inside the check): the check still lines up,
    and every rank raises ProtocolError naming the element count, long before the deadline."""
    with bitcoll.init("mpi", timeout=300) as comm:
        room = comm._transport.record_bytes - 16  # type: ignore[attr-defined]
        n = room // 4 + (1 if comm.rank == comm.size - 1 else 0)
        with pytest.raises(bitcoll.ProtocolError) as info:
            comm.allreduce(np.ones(n, np.float32))
        assert info.value.collective == "allreduce"
        assert "element count" in (info.value.fields or ())
        with pytest.raises(bitcoll.CommError):
            comm.allreduce(np.ones(1, np.float32))


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_mpi_inline_allreduce_bad_arguments_fail_every_rank() -> None:
    """Arguments the fast path does not take go to the general path, which reports them: a
    wrong ``out`` on one rank is a UsageError there and a PeerLostError on the others; an
    ``out`` overlapping ``x`` without being it is a UsageError."""
    # The abort may reach a peer while it is still creating the communicator (rank 0 can
    # leave the set-up's last collective before the others have finished it): on the other
    # ranks the creation is inside the check too.
    from mpi4py import MPI
    if MPI.COMM_WORLD.Get_rank() == 0:
        with bitcoll.init("mpi", timeout=60) as comm, \
                raises_usage("out"):
            comm.allreduce(np.ones(4, np.float32), out=np.empty(4, np.float64))
    else:
        with pytest.raises(bitcoll.PeerLostError, match="expected float32"), \
                bitcoll.init("mpi", timeout=60) as comm:
            comm.allreduce(np.ones(4, np.float32))
    with pytest.raises((bitcoll.UsageError, bitcoll.PeerLostError), match="overlaps"), \
            bitcoll.init("mpi", timeout=60) as comm:
        buf = np.ones(5, np.float32)
        comm.allreduce(buf[:4], out=buf[1:])


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_mpi_barrier_is_the_argument_check() -> None:
    """Over MPI the default barrier is the argument check alone (no bitcoll frames), and it
    still holds every rank until all have entered: with the last rank staying out, the others
    time out, and the last rank then finds the communicator aborted."""
    with bitcoll.init("mpi", timeout=60) as comm:
        comm.stats.reset()
        for _ in range(3):
            comm.barrier()
        assert comm.stats.snapshot()["messages_sent"] == 0
        comm.barrier(algorithm="dissemination")
        assert comm.stats.snapshot()["messages_sent"] > 0
        # Every rank has left the barriers above before the others' timeout can abort them.
        from mpi4py import MPI
        MPI.COMM_WORLD.Barrier()
        if comm.rank != comm.size - 1:
            with pytest.raises(bitcoll.CommError):
                comm.barrier(timeout=1.0)
        # Every rank learns of the abort (an MPI barrier: the transport's is aborted).
        MPI.COMM_WORLD.Barrier()
        with pytest.raises(bitcoll.CommError):
            comm.barrier()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_mpi_small_allgather_and_broadcast_travel_in_the_check() -> None:
    """Over MPI an all-gather or a broadcast whose data fits the argument check's records
    travels inside it (no bitcoll frames), for lengths 0, 1, 7, 8, 9 and the last that fits;
    the results are every rank's seeded data (all-gather) and the root's (broadcast); one
    element more goes the general way and gives the same result."""
    with bitcoll.init("mpi", timeout=60) as comm:
        p = comm.size
        room = comm._transport.record_bytes - 16  # type: ignore[attr-defined]
        for dtype in ("float16", "float64", "int8", "uint64"):
            fits = room // np.dtype(dtype).itemsize
            for n in sorted({0, 1, 7, 8, 9, fits, fits + 1}):
                rows = [_mpi_ranks_data(r, n, dtype) for r in range(p)]
                comm.stats.reset()
                got = comm.allgather(rows[comm.rank])
                np.testing.assert_array_equal(got, np.concatenate(rows))
                root = n % p
                buf = rows[comm.rank].copy()
                assert comm.broadcast(buf, root=root) is buf
                np.testing.assert_array_equal(buf, rows[root])
                frames = comm.stats.snapshot()["messages_sent"]
                assert (frames == 0) == (n <= fits) or n == 0, (dtype, n, frames)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [3, 1000])
def test_mpi_broadcast_roots_that_differ_fail_every_rank(n: int) -> None:
    """Over MPI the argument check compares the broadcast roots (small broadcasts inside it,
    large ones before MPI's or bitcoll's broadcast): every rank raises ProtocolError naming
    the root."""
    with bitcoll.init("mpi", timeout=300) as comm:
        root = 1 if comm.rank == comm.size - 1 else 0
        with pytest.raises(bitcoll.ProtocolError) as info:
            comm.broadcast(np.zeros(n, np.float64), root=root)
        assert info.value.fields == ("root",)


def _ring_from(p: int) -> int:
    """The smallest float32 length whose default all-reduce on ``p`` ranks of one host (the
    default model) is the ring."""
    n = 1
    while choose("allreduce", DEFAULT_MODEL, group_of(p, None, DEFAULT_MODEL),
                 Call(nbytes=4 * n)) != "ring":
        n *= 2
    return n


#: Recursive doubling up to 1001 elements, the ring for the last length.
_MIXED_LENGTHS = (0, 1, 7, 8, 9, 1001, _ring_from(3) + 9)


def _mixed_paths(comm: Communicator) -> list[object]:
    """All-reduces where the ranks take different paths: the synchronous fast path (a
    contiguous numpy vector, no algorithm), the general path (a strided view, a forced
    algorithm, an async call): same frames, same signature, same bits."""
    got: list[object] = []
    for n in _MIXED_LENGTHS:
        base = np.random.default_rng([comm.rank, n]).standard_normal(2 * n).astype(np.float32)
        x = base[::2] if comm.rank % 2 else np.ascontiguousarray(base[::2])
        comm.stats.reset()
        y = comm.allreduce(x)
        frames = comm.stats.snapshot()["messages_sent"]
        algo = choose("allreduce", comm.cost_model, comm.plan_group, Call(nbytes=4 * n))
        assert algo == ("ring" if n == _MIXED_LENGTHS[-1] else "recursive_doubling")
        forced = comm.allreduce(np.ascontiguousarray(x), algorithm=algo)
        late = comm.allreduce(np.ascontiguousarray(x), async_op=True).wait()
        inplace = np.ascontiguousarray(x)
        assert comm.allreduce(inplace, out=inplace, op="max") is inplace
        got.append((y.tobytes(), forced.tobytes(), late.tobytes(), inplace.tobytes(), frames))
    # A mismatch between ranks that take the fast path is still caught: ProtocolError where
    # a header differs, PeerLostError (its abort) elsewhere. The barrier first lets every
    # rank finish the loop's last all-reduce (with 3 ranks the folded rank gets its result
    # last, and the mismatch's abort could otherwise reach it there); the abort may then meet
    # a rank still in the barrier, hence both calls inside.
    with pytest.raises((bitcoll.ProtocolError, bitcoll.PeerLostError), match="different"):
        comm.barrier()
        comm.allreduce(np.ones(4, np.float32 if comm.rank else np.float64))
    return got


def test_fast_allreduce_over_frames_matches_the_general_path() -> None:
    """Off MPI, the synchronous all-reduce of a contiguous numpy vector takes a lean path
    (recursive doubling or the ring without the general path's closures): a rank on it and a
    rank on the general path pair up, and every form gives the seeded sums and maxima."""
    p = 3
    results = run_threads(p, _mixed_paths)
    for i, n in enumerate(_MIXED_LENGTHS):
        rows = [np.random.default_rng([r, n]).standard_normal(2 * n).astype(np.float32)[::2]
                for r in range(p)]
        want_sum = rows[0] + rows[1] + rows[2]
        want_max = np.maximum(np.maximum(rows[0], rows[1]), rows[2])
        for got in results:
            y, forced, late, inplace, frames = got[i]
            assert y == forced == late  # the same bits on every path and rank
            np.testing.assert_allclose(np.frombuffer(y, np.float32), want_sum, rtol=1e-5,
                                       atol=1e-5)
            assert inplace == want_max.tobytes()
            assert frames > 0
    assert len({got[0][0] for got in results}) == 1
