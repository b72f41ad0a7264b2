"""Automatic algorithm choice by size (the packed all-gather baseline for small vectors) and
MPI's own all-reduce refusing float16 before anything is sent."""

from __future__ import annotations

import numpy as np
import pytest
from inproc import run_threads

import bitcoll
from bitcoll.communicator import (
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
