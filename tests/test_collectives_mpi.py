"""Every collective over the MPI transport (run under mpiexec with pytest-mpi:
``mpiexec -n N python -m pytest --with-mpi -m mpi tests``)."""

from __future__ import annotations

import time

import numpy as np
import pytest
from sweeps import (
    dense_sweep,
    float_sweep,
    inplace_and_async,
    mixed_paths_sweep,
    packed_bandwidth,
    packed_sweep,
)

import bitcoll
from bitcoll.communicator import Communicator
from bitcoll.errors import CommError, ProtocolError, UsageError


@pytest.fixture(scope="module")
def comm() -> Communicator:
    c = bitcoll.init("mpi", timeout=120)
    assert c.backend == "mpi"
    return c


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(600)
def test_dense_collectives_mpi(comm: Communicator) -> None:
    assert bitcoll.detect_backend() == "mpi"
    assert dense_sweep(comm) > 100
    assert float_sweep(comm) > 10
    comm.segment_bytes = 40  # many tiny segments (3 or more per block) through the pipelines
    dense_sweep(comm, lengths=(9, 305), dtypes=("float32", "int16"))
    float_sweep(comm, seed=1, lengths=(9, 305))
    comm.segment_bytes = bitcoll.DEFAULT_SEGMENT_BYTES
    inplace_and_async(comm)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(300)
def test_streaming_and_frame_by_frame_ranks_interoperate() -> None:
    """Every ring collective with rank 1 making its frames one by one and the others
    streaming theirs (``MPITransport.stream``): results as expected everywhere, and the
    streaming ranks did stream."""
    with bitcoll.init("mpi", timeout=120) as fresh:
        checks, streamed = mixed_paths_sweep(fresh)
        assert checks > 10
        if fresh.rank == 1:
            assert streamed == 0
        else:
            assert streamed > 10


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(300)
def test_native_mpi_algorithms(comm: Communicator) -> None:
    for dt in ("float32", "float64", "int32", "int64", "uint8"):
        dense_sweep(comm, lengths=(0, 1, 9, 1000), dtypes=(dt,), algorithms=("native",))
    float_sweep(comm, dtypes=("float32", "float64"), algorithms=("native",))
    p, r = comm.size, comm.rank
    x = np.arange(6, dtype=np.float64) + r
    got = comm.reduce_scatter(x, algorithm="native")
    lo, hi = bitcoll.block(6, p, r)
    assert np.array_equal(got, (np.arange(6) * p + p * (p - 1) / 2)[lo:hi])
    buf = x.copy()
    comm.broadcast(buf, root=p - 1, algorithm="native")
    assert np.array_equal(buf, np.arange(6) + p - 1)
    comm.barrier(algorithm="native")


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(600)
def test_packed_collectives_mpi(comm: Communicator) -> None:
    packed_sweep(comm)
    comm.packed_segment_bytes = 8  # 64-element segments: multi-segment pipeline on every block
    packed_sweep(comm, lengths=(65, 1031))
    comm.packed_segment_bytes = None
    packed_bandwidth(comm)


def _fresh() -> Communicator:
    return bitcoll.init("mpi", timeout=30)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", ["length", "dtype", "collective", "out"])
def test_mismatch_fails_every_rank_fast(case: str) -> None:
    from mpi4py import MPI

    odd = MPI.COMM_WORLD.rank == MPI.COMM_WORLD.size - 1
    t0 = time.monotonic()
    c: Communicator | None = None
    # A rank's UsageError right after init aborts the communicator, so a peer may still be
    # inside init's own collective (the topology exchange) when it hears of it.
    with pytest.raises((CommError, UsageError)) as info:
        c = _fresh()
        if case == "length":
            c.allreduce(np.ones(100 + odd, np.float32))
        elif case == "dtype":
            c.allreduce(np.ones(100, np.float64 if odd else np.float32))
        elif case == "collective":
            if odd:
                c.allgather(np.ones(4))
            else:
                c.allreduce(np.ones(4))
        else:
            c.allreduce(np.ones(10), out=np.ones(11 if odd else 10))
    assert time.monotonic() - t0 < 30  # before the 30 s deadline: nobody waited it out
    if case == "out" and odd:
        assert info.type is UsageError
    elif case != "out":
        assert issubclass(info.type, (ProtocolError, CommError))
    if c is not None:
        with pytest.raises(CommError):
            c.allreduce(np.ones(1))
        c.close()


@pytest.mark.mpi(min_size=3)
@pytest.mark.timeout(300)
def test_collectives_on_split_transports() -> None:
    """A communicator over each parity group of an MPI transport split (the bitcoll
    algorithms and MPI's own), while the parent transport stays usable."""
    from bitcoll.transport.mpi import MPITransport

    parent = MPITransport.create(timeout=60)
    try:
        color = parent.rank % 2
        members = [r for r in range(parent.size) if r % 2 == color]
        sub = parent.split(color, key=parent.rank)
        assert sub is not None
        with Communicator(sub, timeout=60) as c:
            assert (c.rank, c.size, c.backend) == (members.index(parent.rank), len(members),
                                                   "mpi")
            got = c.allreduce(np.full(1001, parent.rank + 1, np.float32))
            assert np.all(got == sum(r + 1 for r in members))
            got = c.allreduce(np.full(9, parent.rank + 1, np.int64), algorithm="native")
            assert np.all(got == sum(r + 1 for r in members))
            assert dense_sweep(c, lengths=(1, 1000), dtypes=("float32", "int16")) > 0
            packed_sweep(c, lengths=(65, 4099))
        parent.native_barrier(time.monotonic() + 60)
    finally:
        parent.close()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(90)
@pytest.mark.parametrize("case,fields", [("length", ("element count",)), ("op", ("op",)),
                                         ("collective", ("collective",))])
def test_mismatch_names_the_field_and_the_collective_number(case: str,
                                                            fields: tuple[str, ...]) -> None:
    """Every rank raises the same finding as over TCP (test_collectives_tcp): ProtocolError
    with ``fields`` naming what differs, the program's first collective numbered #0 (init's
    own collectives not counted) and the message "<collective> #0: the ranks called ..."."""
    from mpi4py import MPI

    last = MPI.COMM_WORLD.rank == MPI.COMM_WORLD.size - 1
    with _fresh() as c, pytest.raises(ProtocolError) as info:
        if case == "length":
            c.allreduce(np.ones(10 + last, np.float32))
        elif case == "op":
            c.sign_allreduce(np.ones(10, np.float32), op="sum" if last else "majority")
        elif last:
            c.allgather(np.ones(4, np.float32))
        else:
            c.allreduce(np.ones(4, np.float32))
    exc = info.value
    assert exc.fields == fields
    assert exc.sequence == 0 and exc.rank == MPI.COMM_WORLD.rank
    assert str(exc).startswith(f"{exc.collective} #0: the ranks called ")
