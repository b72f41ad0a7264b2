"""Automatic algorithm choice by size (the packed all-gather baseline for small vectors, MPI's
own all-reduce for small vectors over MPI, behind the argument check) and MPI's own all-reduce
refusing float16 before anything is sent."""

from __future__ import annotations

import numpy as np
import pytest
from inproc import run_threads

import bitcoll
from bitcoll.communicator import (
    NATIVE_ALLREDUCE_MAX_BYTES,
    PACKED_ALLGATHER_MAX_EXCESS,
    Communicator,
    packed_auto_algorithm,
)
from bitcoll.transport.base import HEADER_SIZE


def test_packed_auto_algorithm_rule() -> None:
    assert packed_auto_algorithm(10**9, 2) == "allgather"  # 2 ranks: never more bytes
    assert packed_auto_algorithm(1000, 4) == "allgather"
    assert packed_auto_algorithm(64 << 20, 4) == "direct"
    # The boundary: excess bytes of the all-gather over the direct exchange.
    p = 4
    n = int(PACKED_ALLGATHER_MAX_EXCESS * 8 * p / ((p - 1) * (p - 2)))
    assert packed_auto_algorithm(n, p) == "allgather"
    assert packed_auto_algorithm(n + 64, p) == "direct"
    # Wider sums make the all-gather's excess grow faster.
    assert packed_auto_algorithm(200_000, 8, 5, 9) == "direct"


def _default_bytes(comm: Communicator) -> list[int]:
    sent = []
    for n in (1000, 2_000_003):
        x = np.random.default_rng([comm.rank, n]).standard_normal(n).astype(np.float32)
        comm.barrier()
        comm.stats.reset()
        y = comm.sign_allreduce(x)
        snap = comm.stats.snapshot()
        sent.append(snap["bytes_sent"] - HEADER_SIZE * snap["messages_sent"])
        z = comm.sign_allreduce(x, algorithm="direct")
        np.testing.assert_array_equal(y, z)  # same votes whichever algorithm ran
    return sent


def test_packed_default_picks_by_size() -> None:
    p = 3
    for sent in run_threads(p, _default_bytes):
        assert sent[0] == (p - 1) * -(-1000 // 8)  # all-gather: the whole vector to each peer
        assert sent[1] < (p - 1) * 2_000_003 // 8  # direct: less than the all-gather


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
    bitcoll frames are sent: native traffic is not counted) and bitcoll's own above it and
    for float16, which MPI cannot reduce; every rank gets the exact result (integers) and the
    same bits (floats) either way."""
    limit = NATIVE_ALLREDUCE_MAX_BYTES // 4
    with bitcoll.init("mpi", timeout=60) as comm:
        for n, dtype, native in [(0, "float32", True), (1, "int32", True),
                                 (9, "float64", True), (limit, "float32", True),
                                 (limit + 1, "float32", False), (9, "float16", False)]:
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
        with pytest.raises(bitcoll.ProtocolError, match=words[differ]) as info:
            comm.allreduce(np.ones(n, dtype), op=op, algorithm=algorithm)
        assert info.value.sequence is not None
        with pytest.raises(bitcoll.CommError):  # the communicator is unusable afterwards
            comm.allreduce(np.ones(2, np.float32))
